"""What sits in each rank's memory: the measured ledger, the estimator that predicts it, the
measured-vs-formula comparison across strategies, charts, and the strategy advisor."""

from nbdist.memory.breakdown import MemoryReport, RankMemory, memory_breakdown
from nbdist.memory.compare import StrategyComparison, compare_strategies
from nbdist.memory.estimate import MemoryEstimate, TransformerShape, estimate_memory

__all__ = [
    "MemoryEstimate", "MemoryReport", "RankMemory", "StrategyComparison", "TransformerShape",
    "compare_strategies", "estimate_memory", "memory_breakdown",
]

"""What sits in each rank's memory: the measured ledger, the estimator that predicts it, the
measured-vs-formula comparison across strategies, charts, and the strategy advisor."""

from nbdist.memory.breakdown import *  # noqa: F401,F403
from nbdist.memory.breakdown import __all__ as _breakdown_all
from nbdist.memory.estimate import MemoryEstimate, TransformerShape, estimate_memory

__all__ = [*_breakdown_all, "MemoryEstimate", "TransformerShape", "estimate_memory"]

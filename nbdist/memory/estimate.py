"""Per-rank memory from formulas: the ZeRO paper's model-state bytes and Korthikanti's activations.

Pure arithmetic (no torch unless a model is passed to count its parameters), so it runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbdist.strategies.base import Strategy
from nbdist.strategies.registry import get_strategy


@dataclass(frozen=True)
class TransformerShape:
    """A GPT-like decoder, enough for parameter and activation formulas."""

    layers: int
    """Number of transformer blocks (L)."""
    hidden: int
    """Model width (h)."""
    heads: int
    """Attention heads (a)."""
    seq_len: int
    """Tokens per sequence (s)."""
    vocab_size: int = 0
    """Embedding rows (V); 0 leaves embeddings out of the parameter count."""

    @property
    def param_count(self) -> int:
        """12·L·h² + 13·L·h (attention, MLP, norms, biases) + V·h + s·h (embeddings)."""
        h, layers = self.hidden, self.layers
        return 12 * layers * h * h + 13 * layers * h + self.vocab_size * h + self.seq_len * h

    def activation_bytes(
        self, micro_batch: int, checkpointing: bool = False, bytes_per_value: int = 2
    ) -> float:
        """Activations saved for backward, all layers (Korthikanti et al. 2022, no tensor parallel).

        Per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit; with full recomputation only each layer's
        input (2·s·b·h) stays, plus one layer's activations while it is recomputed.
        """
        s, b, h, a = self.seq_len, micro_batch, self.hidden, self.heads
        per_layer = s * b * h * (34 + 5 * a * s / h) * bytes_per_value / 2
        if checkpointing:
            return self.layers * s * b * h * bytes_per_value + per_layer
        return self.layers * per_layer


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank predicted for one strategy (1 GB = 1e9 bytes, as in the ZeRO paper)."""

    strategy: str
    world_size: int
    param_count: int
    params: float
    """Parameter bytes resident on the device."""
    grads: float
    optimizer: float
    """Optimizer state incl. fp32 master weights (K·Ψ, sharded or not)."""
    activations: float | None
    """From the transformer formula when a shape and micro-batch were given."""
    offloaded: float
    """Model-state bytes moved to CPU memory (or NVMe) by offloading."""
    formula: str

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0)

    def as_gb(self) -> dict[str, float]:
        values = {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "model_states": self.model_states,
            "activations": self.activations or 0.0,
            "offloaded": self.offloaded,
        }
        return {k: round(v / 1e9, 3) for k, v in values.items()}


def bytes_per_param(strategy: str, precision: str) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter for Adam under ``strategy`` (see
    :func:`nbdist.strategies.base.adam_bytes`: DeepSpeed's ZeRO keeps K = 12 even in fp32)."""
    return get_strategy(strategy).bytes_per_param(precision)


def normalize_strategy(strategy: str, zero_stage: int | None = None) -> str:
    """The one name of ``strategy`` (an alias, or "deepspeed" with ``zero_stage``)."""
    return get_strategy(strategy, zero_stage).name


def count_params(model_or_count: Any) -> int:
    if isinstance(model_or_count, TransformerShape):
        return model_or_count.param_count
    if isinstance(model_or_count, (int, float)):
        return int(model_or_count)
    if hasattr(model_or_count, "parameters"):
        return sum(p.numel() for p in model_or_count.parameters())
    raise TypeError(
        "expected a parameter count, an nn.Module or a TransformerShape, not"
        f" {type(model_or_count).__name__}"
    )


def estimate_memory(
    model_or_param_count: Any,
    world_size: int,
    strategy: str = "ddp",
    *,
    zero_stage: int | None = None,
    precision: str = "mixed",
    optimizer_bytes: float | None = None,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    transformer: TransformerShape | None = None,
    micro_batch: int | None = None,
    activation_checkpointing: bool = False,
) -> MemoryEstimate:
    """Model-state bytes per rank from the ZeRO paper (arXiv:1910.02054 §5), plus activations.

    ``strategy``: ddp, zero0-zero3, fsdp (full shard) or fsdp_shard_grad_op, the names
    ``nbdist.prepare`` takes; "deepspeed" with ``zero_stage`` (default 2) works too.
    ``precision``: "mixed" (Ψ·(2 + 2 + K), K = 12) or "fp32" (see :func:`bytes_per_param`).
    ``optimizer_bytes`` overrides K (e.g. 4 for SGD with momentum in fp32).
    Offloading moves the optimizer state (and, for ZeRO-Offload, the fp32 gradient partition)
    or the parameter shards to ``offloaded``. Activations need ``transformer`` (or a
    TransformerShape as the first argument) and ``micro_batch``.
    """
    chosen = get_strategy(strategy, zero_stage)
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one rank")
    psi = count_params(model_or_param_count)
    p_bytes, g_bytes, k_bytes = chosen.bytes_per_param(precision)
    if optimizer_bytes is not None:
        k_bytes = float(optimizer_bytes)
    shard, n = chosen.sharding, world_size
    per_param = ((p_bytes, shard.params), (g_bytes, shard.grads), (k_bytes, shard.optimizer))
    p, g, k = (b * psi / (n if sharded else 1) for b, sharded in per_param)
    params, grads, optimizer, offloaded = _offload(
        chosen, (p, g, k), offload_optimizer, offload_param
    )
    shape = transformer
    if shape is None and isinstance(model_or_param_count, TransformerShape):
        shape = model_or_param_count
    activations = None
    if shape is not None and micro_batch is not None:
        value_bytes = 2 if precision == "mixed" else 4
        activations = shape.activation_bytes(micro_batch, activation_checkpointing, value_bytes)
    formula = " + ".join(f"{b:g}Ψ/N" if sharded else f"{b:g}Ψ" for b, sharded in per_param)
    return MemoryEstimate(
        chosen.name, n, psi, params, grads, optimizer, activations, offloaded, formula
    )


def _offload(
    strategy: Strategy,
    resident: tuple[float, float, float],
    offload_optimizer: bool,
    offload_param: bool,
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, offloaded) bytes once the requested offloading is applied."""
    params, grads, optimizer = resident
    shard = strategy.sharding
    if not (offload_optimizer or offload_param):
        return params, grads, optimizer, 0.0
    if not (shard.params or shard.grads or shard.optimizer):
        who = "DDP" if strategy.family == "ddp" else f"ZeRO stage 0 ({strategy.name})"
        raise ValueError(f"{who} cannot offload: use zero1/2/3 or fsdp")
    if strategy.family == "fsdp":
        # FSDP's CPUOffloadPolicy moves params, grads and the optimizer step together.
        return 0.0, 0.0, 0.0, params + grads + optimizer
    offloaded = 0.0
    if offload_optimizer:
        # ZeRO-Offload keeps the fp32 gradient partition on the CPU beside the optimizer.
        offloaded += optimizer + (grads if shard.grads else 0.0)
        optimizer, grads = 0.0, (0.0 if shard.grads else grads)
    if offload_param:
        if not shard.params:
            raise ValueError("parameter offload needs sharded parameters: use zero3 or fsdp")
        offloaded, params = offloaded + params, 0.0
    return params, grads, optimizer, offloaded

"""``nbdist.advise``: is plain DDP enough, or which sharding and offload to use, and why.

Follows the ZeRO formulas (nbdist.estimate_memory) and Lightning's rule of thumb: below ~500M
parameters, when weights, gradients and optimizer state fit on one GPU, DDP wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbdist.memory.estimate import count_params, estimate_memory

DDP_PARAM_LIMIT = 500_000_000
"""Below this many parameters DDP is recommended whenever its model states fit."""

HEADROOM = 0.8
"""Share of GPU memory model states may take; the rest is for activations, buffers and the CUDA
context."""


@dataclass(frozen=True)
class Advice:
    """A recommendation: the strategy name, the ``nbdist.prepare`` call that realises it, and
    why."""

    strategy: str
    """ddp, zero2, zero3, zero3+offload_optimizer, zero3+offload, or none (does not fit)."""
    prepare_kwargs: dict[str, Any]
    """Arguments for ``nbdist.prepare(model, optimizer, **prepare_kwargs)`` (DeepSpeed form)."""
    fsdp_kwargs: dict[str, Any] | None
    """The FSDP2 equivalent where there is one."""
    per_gpu_bytes: float
    """Model-state bytes per GPU under the recommendation (ZeRO formulas)."""
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.strategy}: " + " ".join(self.reasons)


def advise(
    param_count_or_model: Any,
    gpus: int,
    gpu_memory: float,
    *,
    precision: str = "mixed",
    activation_bytes: float = 0.0,
    cpu_memory: float | None = None,
) -> Advice:
    """Recommend a strategy for training on ``gpus`` GPUs of ``gpu_memory`` bytes each.

    ``activation_bytes``: per-GPU activations you expect (see TransformerShape.activation_bytes);
    ``cpu_memory``: host memory per GPU available for offloading (None: assume enough).
    """
    psi = count_params(param_count_or_model)
    budget = gpu_memory * HEADROOM - activation_bytes
    ddp, zero2, zero3 = (
        estimate_memory(psi, gpus, s, precision=precision) for s in ("ddp", "zero2", "zero3")
    )
    intro = (
        f"{_millions(psi)} parameters need {_size(ddp.model_states)} of model states per GPU"
        f" under DDP; the budget is {_size(budget)} per GPU ({HEADROOM:.0%} of {_size(gpu_memory)}"
    )
    intro += f" minus {_size(activation_bytes)} of activations)." if activation_bytes else ")."

    if ddp.model_states <= budget and psi < DDP_PARAM_LIMIT:
        why = (
            "They fit, and below ~500M parameters sharding only adds communication: plain DDP"
            " is fastest (one all-reduce of gradients per step, overlapped with backward)."
        )
        return Advice("ddp", {"strategy": "ddp"}, None, ddp.model_states, [intro, why])
    if gpus == 1:
        return _offload_single_gpu(psi, budget, precision, cpu_memory, intro)
    if zero2.model_states <= budget:
        why_not_ddp = (
            "they fit, but at this size sharding frees memory for larger batches at no extra"
            " communication" if ddp.model_states <= budget else "they do not fit"
        )
        why = (
            f"{why_not_ddp.capitalize()}. ZeRO-2 / FSDP SHARD_GRAD_OP shards gradients and"
            f" optimizer state ({zero2.formula}: {_size(zero2.model_states)}) with the same"
            " communication volume as DDP (reduce-scatter + all-gather = one all-reduce)."
        )
        return _zero(2, zero2.model_states, [intro, why])
    if zero3.model_states <= budget:
        why = (
            f"ZeRO-2 would still need {_size(zero2.model_states)}. ZeRO-3 / FSDP FULL_SHARD shards"
            f" the parameters too ({_size(zero3.model_states)} per GPU) for about 1.5x DDP's"
            " communication (parameters are gathered in forward and again in backward)."
        )
        return _zero(3, zero3.model_states, [intro, why])
    return _offload(psi, gpus, budget, precision, cpu_memory, intro)


def _zero(stage: int, per_gpu_bytes: float, reasons: list[str]) -> Advice:
    """ZeRO-2 or ZeRO-3 under DeepSpeed, beside FSDP2's equivalent (resharding after forward: 3)."""
    deepspeed = {"strategy": "deepspeed", "zero_stage": stage}
    fsdp = {"strategy": "fsdp", "reshard_after_forward": stage == 3}
    return Advice(f"zero{stage}", deepspeed, fsdp, per_gpu_bytes, reasons)


def _offload(
    psi: int, gpus: int, budget: float, precision: str, cpu_memory: float | None, intro: str
) -> Advice:
    zero3 = {"strategy": "deepspeed", "zero_stage": 3}
    fsdp = {"strategy": "fsdp", "cpu_offload": True}
    opt_off = estimate_memory(psi, gpus, "zero3", precision=precision, offload_optimizer=True)
    if opt_off.model_states <= budget and _cpu_ok(opt_off.offloaded, cpu_memory):
        on_gpu = estimate_memory(psi, gpus, "zero3", precision=precision).model_states
        why = (
            f"Even ZeRO-3 needs {_size(on_gpu)}. Offloading the optimizer (state and step on the"
            f" CPU) leaves {_size(opt_off.model_states)} per GPU and puts"
            f" {_size(opt_off.offloaded)} per GPU in host memory; steps get slower (PCIe traffic,"
            " CPU Adam)."
        )
        deepspeed = {**zero3, "offload_optimizer": "cpu"}
        return Advice(
            "zero3+offload_optimizer", deepspeed, fsdp, opt_off.model_states, [intro, why]
        )
    full_off = estimate_memory(
        psi, gpus, "zero3", precision=precision, offload_optimizer=True, offload_param=True
    )
    if _cpu_ok(full_off.offloaded, cpu_memory):
        why = (
            "Parameters must leave the GPU too: ZeRO-3 with optimizer and parameter offload"
            " keeps only the layer being computed on the GPU and"
            f" {_size(full_off.offloaded)} per GPU in host memory (slowest option)."
        )
        deepspeed = {**zero3, "offload_optimizer": "cpu", "offload_param": "cpu"}
        return Advice("zero3+offload", deepspeed, fsdp, full_off.model_states, [intro, why])
    why = (
        f"Host memory ({_size(cpu_memory or 0)} per GPU) cannot hold the offloaded"
        f" {_size(full_off.offloaded)}: add GPUs, offload to NVMe (ZeRO-Infinity, needs"
        " DeepSpeed's async_io), or shrink the model."
    )
    nvme = {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": "/local/nvme"}
    return Advice("none", {**zero3, **nvme}, None, full_off.model_states, [intro, why])


def _offload_single_gpu(
    psi: int, budget: float, precision: str, cpu_memory: float | None, intro: str
) -> Advice:
    off = estimate_memory(psi, 1, "zero2", precision=precision, offload_optimizer=True)
    if off.model_states <= budget and _cpu_ok(off.offloaded, cpu_memory):
        why = (
            "With one GPU there is nothing to shard across; ZeRO-Offload moves gradients and"
            f" optimizer state to the CPU, leaving {_size(off.model_states)} of parameters on the"
            " GPU."
        )
        deepspeed = {"strategy": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu"}
        return Advice("zero2+offload_optimizer", deepspeed, None, off.model_states, [intro, why])
    return _offload(psi, 1, budget, precision, cpu_memory, intro)


def _cpu_ok(offloaded: float, cpu_memory: float | None) -> bool:
    return cpu_memory is None or offloaded <= cpu_memory * HEADROOM


def _millions(count: float) -> str:
    """1,558M; 0.53M for a model too small to round to a whole million."""
    return f"{count / 1e6:,.0f}M" if count >= 1e7 else f"{count / 1e6:.2g}M"


def _size(n: float) -> str:
    """GB to one decimal, or MB below 0.1 GB (a small model's states are not "0.0 GB")."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

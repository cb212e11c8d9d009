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
"""Share of GPU memory model states may take; the rest is for activations, buffers and the CUDA context."""


@dataclass(frozen=True)
class Advice:
    """A recommendation: the strategy name, the ``nbdist.prepare`` call that realises it, and why."""

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
    gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
    est = {s: estimate_memory(psi, gpus, s, precision=precision) for s in ("ddp", "zero2", "zero3")}
    head = f"{psi / 1e6:,.0f}M parameters need {gb(est['ddp'].model_states)} of model states per GPU under DDP; "
    fit = f"the budget is {gb(budget)} per GPU ({HEADROOM:.0%} of {gb(gpu_memory)}"
    fit += f" minus {gb(activation_bytes)} of activations)." if activation_bytes else ")."

    if est["ddp"].model_states <= budget and psi < DDP_PARAM_LIMIT:
        return Advice("ddp", {"strategy": "ddp"}, None, est["ddp"].model_states, [
            head + fit, "They fit, and below ~500M parameters sharding only adds communication: plain DDP "
            "is fastest (one all-reduce of gradients per step, overlapped with backward)."])
    if gpus == 1:
        return _offload_single_gpu(psi, budget, precision, cpu_memory, head + fit)
    why_not_ddp = ("they fit, but at this size sharding frees memory for larger batches at no extra "
                   "communication" if est["ddp"].model_states <= budget else "they do not fit")
    if est["zero2"].model_states <= budget:
        return Advice("zero2", {"strategy": "deepspeed", "zero_stage": 2},
                      {"strategy": "fsdp", "reshard_after_forward": False}, est["zero2"].model_states, [
            head + fit, f"{why_not_ddp.capitalize()}. ZeRO-2 / FSDP SHARD_GRAD_OP shards gradients and "
            f"optimizer state ({est['zero2'].formula}: {gb(est['zero2'].model_states)}) with the same "
            "communication volume as DDP (reduce-scatter + all-gather = one all-reduce)."])
    if est["zero3"].model_states <= budget:
        return Advice("zero3", {"strategy": "deepspeed", "zero_stage": 3},
                      {"strategy": "fsdp", "reshard_after_forward": True}, est["zero3"].model_states, [
            head + fit, f"ZeRO-2 would still need {gb(est['zero2'].model_states)}. ZeRO-3 / FSDP FULL_SHARD "
            f"shards the parameters too ({gb(est['zero3'].model_states)} per GPU) for about 1.5x DDP's "
            "communication (parameters are gathered in forward and again in backward)."])
    return _offload(psi, gpus, budget, precision, cpu_memory, head + fit)


def _offload(psi: int, gpus: int, budget: float, precision: str, cpu_memory: float | None, intro: str) -> Advice:
    gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
    opt_off = estimate_memory(psi, gpus, "zero3", precision=precision, offload_optimizer=True)
    if opt_off.model_states <= budget and _cpu_ok(opt_off.offloaded, cpu_memory):
        return Advice("zero3+offload_optimizer", {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu"},
                      {"strategy": "fsdp", "cpu_offload": True}, opt_off.model_states, [
            intro, f"Even ZeRO-3 needs {gb(estimate_memory(psi, gpus, 'zero3', precision=precision).model_states)}. "
            f"Offloading the optimizer (state and step on the CPU) leaves {gb(opt_off.model_states)} per GPU and "
            f"puts {gb(opt_off.offloaded)} per GPU in host memory; steps get slower (PCIe traffic, CPU Adam)."])
    full_off = estimate_memory(psi, gpus, "zero3", precision=precision, offload_optimizer=True, offload_param=True)
    if _cpu_ok(full_off.offloaded, cpu_memory):
        return Advice("zero3+offload", {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu",
                                        "offload_param": "cpu"},
                      {"strategy": "fsdp", "cpu_offload": True}, full_off.model_states, [
            intro, f"Parameters must leave the GPU too: ZeRO-3 with optimizer and parameter offload keeps only the "
            f"layer being computed on the GPU and {gb(full_off.offloaded)} per GPU in host memory (slowest option)."])
    return Advice("none", {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": "nvme",
                           "offload_param": "nvme", "nvme_path": "/local/nvme"}, None, full_off.model_states, [
        intro, f"Host memory ({gb(cpu_memory or 0)} per GPU) cannot hold the offloaded {gb(full_off.offloaded)}: "
        "add GPUs, offload to NVMe (ZeRO-Infinity, needs DeepSpeed's async_io), or shrink the model."])


def _offload_single_gpu(psi: int, budget: float, precision: str, cpu_memory: float | None, intro: str) -> Advice:
    gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
    off = estimate_memory(psi, 1, "zero2", precision=precision, offload_optimizer=True)
    if off.model_states <= budget and _cpu_ok(off.offloaded, cpu_memory):
        return Advice("zero2+offload_optimizer", {"strategy": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu"},
                      None, off.model_states, [
            intro, "With one GPU there is nothing to shard across; ZeRO-Offload moves gradients and optimizer "
            f"state to the CPU, leaving {gb(off.model_states)} of parameters on the GPU."])
    return _offload(psi, 1, budget, precision, cpu_memory, intro)


def _cpu_ok(offloaded: float, cpu_memory: float | None) -> bool:
    return cpu_memory is None or offloaded <= cpu_memory * HEADROOM

"""``nbdist.memory_breakdown``: what sits in each rank's memory now, measured (model states
exactly, activations from one forward), as a table and a stacked bar chart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from nbdist.errors import NbdistWarning
from nbdist.memory.chart import render_svg, render_table
from nbdist.memory.wrapping import LABELS, unwrap_trainer, wrapping

__all__ = ["MemoryReport", "RankMemory", "memory_breakdown"]


@dataclass
class RankMemory:
    """One rank's memory in bytes. Model states are exact (storage accounting); the rest is not."""

    rank: int
    device: str
    params: int
    """Parameters (and module buffers) on the device: full, DTensor shard or ZeRO partition."""
    grads: int
    optimizer: int
    """Optimizer state incl. fp32 master copies (DeepSpeed's flat partitions)."""
    activations: int | None = None
    """Bytes autograd saved for backward during one forward of the given batch (its peak)."""
    gathered: int | None = None
    """Full parameters gathered from other ranks beside this rank's shard: ZeRO-3's small
    "persistent" params and those kept for reuse, plus what the measured forward kept alive
    (ZeRO-3 for backward; FSDP2 with reshard_after_forward=False)."""
    buffers: int = 0
    """Strategy scratch found in the optimizer (e.g. ZeRO reduce buckets)."""
    other: int | None = None
    """On the device but none of the above (CPU: malloc'd heap; CUDA: memory_allocated)."""
    offloaded: int = 0
    """Model-state bytes held in CPU memory while the rank computes on a GPU."""
    allocated: int | None = None
    """The allocator's view: CPU heap in use (glibc mallinfo2) or torch.cuda.memory_allocated."""
    reserved: int | None = None
    """CUDA: memory_reserved (allocated + cached blocks); CPU: resident set size."""
    peak_forward: int | None = None
    """CUDA: the most allocated during the measured forward, minus what was allocated before
    (torch's peak counter is read, never reset: see forward_peak)."""
    wrapping: str = "none"
    """What wraps the model on this rank: ddp, fsdp (FSDP2), fsdp1, zero0-3 (DeepSpeed), none."""
    wrapping_mismatch: str | None = None
    """One line when the model did not get the wrapping its Trainer's arguments asked for."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def row(self) -> dict[str, Any]:
        rest = (self.activations or 0) + (self.gathered or 0) + self.buffers + (self.other or 0)
        return {
            **asdict(self), "model_states": self.model_states, "total": self.model_states + rest
        }


@dataclass
class MemoryReport:
    """Every rank's :class:`RankMemory`; shows as a table (text) and a stacked bar chart (HTML)."""

    ranks: list[RankMemory] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        return [r.row() for r in self.ranks]

    def headline(self) -> str:
        """The wrappings the ranks' models got (one where all agree) and any mismatch warning."""
        labels = sorted({LABELS.get(r.wrapping, r.wrapping) for r in self.ranks})
        mismatches = sorted({r.wrapping_mismatch for r in self.ranks if r.wrapping_mismatch})
        lines = [f"model wrapped by: {', '.join(labels)}", *(f"warning: {m}" for m in mismatches)]
        return "\n".join(lines)

    def table(self) -> str:
        columns = (
            "params", "grads", "optimizer", "activations", "gathered", "buffers", "other", "total"
        )
        return self.headline() + "\n" + render_table(self.rows(), columns)

    def to_svg(self) -> str:
        rows = [
            {**r, "other": (r["other"] or 0) + (r["gathered"] or 0) + r["buffers"]}
            for r in self.rows()
        ]
        return render_svg(rows)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html

        return f"<div>{self.to_svg()}<pre>{html.escape(self.table())}</pre></div>"


def memory_breakdown(
    model: Any,
    optimizer: Any = None,
    batch: Any = None,
    loss_fn: Callable[[Any], Any] | None = None,
    *,
    gather: bool = True,
) -> MemoryReport:
    """Measure this rank's memory now; with ``gather`` (a collective) return every rank's.

    ``model`` may be a plain module, DDP, an FSDP2 module, a DeepSpeedEngine or a Hugging Face
    ``Trainer``; ``optimizer`` the matching optimizer (found on a DeepSpeedEngine or a Trainer).
    The report says which wrapping the model got; when a Trainer asked for FSDP or DeepSpeed and
    the model got something else (DDP on CPU), an ``NbdistWarning`` says so.

    With ``batch`` (a tensor, a tuple of positional inputs or a dict of keyword inputs) one
    forward runs with autograd recording, and the bytes it saves for backward are the
    activations: that is their peak, reached at the end of forward. ``loss_fn(output)`` adds the
    loss's own. The graph is then dropped without backward, so parameters, gradients and
    optimizer state are left exactly as they were (ZeRO-3's weights gathered for the forward are
    partitioned again).

    DeepSpeed ZeRO-1/2 free their gradient partition inside ``step()``: measure between
    ``backward`` and ``step`` to see gradients (ZeRO-1's full ones only while it accumulates).
    """
    import torch

    from nbdist.memory.ledger import account

    model, optimizer, asked = unwrap_trainer(model, optimizer)
    device = _device_of(model)
    wrapped = wrapping(model, asked, device.type)
    if wrapped.mismatch():
        warnings.warn(wrapped.mismatch(), NbdistWarning, stacklevel=2)
    ledger = account(model, optimizer, device.type)
    activations = peak_forward = None
    gathered = ledger.bytes["gathered"]
    if batch is not None:
        activations, forward_gathered, peak_forward = _forward_activations(
            model, batch, loss_fn, ledger.seen, device
        )
        gathered += forward_gathered
    states = sum(ledger.bytes.values())  # resident now: what the forward gathered is freed again
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    else:
        allocated, reserved = _heap_in_use(), _rss()
    other = None if allocated is None else max(allocated - states, 0)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    mine = RankMemory(
        rank=rank, device=str(device), params=ledger.bytes["params"], grads=ledger.bytes["grads"],
        optimizer=ledger.bytes["optimizer"], activations=activations, gathered=gathered,
        buffers=ledger.bytes["buffers"], other=other, offloaded=ledger.offloaded,
        allocated=allocated, reserved=reserved, peak_forward=peak_forward,
        wrapping=wrapped.got, wrapping_mismatch=wrapped.mismatch(),
    )
    return MemoryReport(gather_from_ranks(mine) if gather else [mine])


def gather_from_ranks(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a collective; ``[mine]`` without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _device_of(model: Any) -> Any:
    import torch

    from nbdist.strategies._common import rank_device

    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        if local.device.type not in ("meta", "cpu"):
            return local.device
    return rank_device() if torch.cuda.is_available() else torch.device("cpu")


def _forward_activations(
    model: Any, batch: Any, loss_fn: Any, exclude: set, device: Any
) -> tuple[int, int, int | None]:
    """Bytes saved for backward by one forward: (activations, gathered parameters, CUDA peak)."""
    import torch

    # DDP's and DeepSpeed's wrappers expect a backward after every forward; the inner module
    # computes the same activations (ZeRO-3 and FSDP2 hooks live on the inner module itself).
    outer = type(model).__module__.startswith(("torch.nn.parallel", "deepspeed"))
    runnable = model.module if outer else model
    saved: list[torch.Tensor] = []

    # The graph keeps only an index; the tensors stay alive in `saved` (as the graph would keep
    # them) until counted. Handing the tensor itself back would make a cycle through autograd's
    # C++ nodes (an output saved by its own grad_fn) that gc cannot see: every call would leak.
    cuda = device.type == "cuda"
    most_seen = [0]

    def pack(tensor: torch.Tensor) -> int:
        saved.append(tensor)
        if cuda:  # a reading as each tensor is saved: the peak when torch's counter cannot say
            most_seen[0] = max(most_seen[0], torch.cuda.memory_allocated(device))
        return len(saved) - 1

    def unpack(_index: int) -> torch.Tensor:
        raise RuntimeError("memory_breakdown's measuring forward has no backward")

    zero3_gathered_before = _zero3_available(runnable)
    if cuda:
        torch.cuda.synchronize(device)
        before = most_seen[0] = torch.cuda.memory_allocated(device)
        counter_before = torch.cuda.max_memory_allocated(device)  # never reset: the user's
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        if isinstance(batch, dict):
            output = runnable(**batch)
        elif isinstance(batch, (tuple, list)):
            output = runnable(*batch)
        else:
            output = runnable(batch)
        loss = loss_fn(output) if loss_fn is not None else output
    peak = forward_peak(before, counter_before, torch.cuda.max_memory_allocated(device),
                        max(most_seen[0], torch.cuda.memory_allocated(device))) if cuda else None
    seen = set(exclude)
    # Wrappers that keep parameters gathered after forward expose them as the module's parameters.
    param_keys = {_storage_key(p) for p in runnable.parameters()}
    totals = {"activations": 0, "gathered": 0}
    # Counted after forward: FSDP2 (resharding) and ZeRO-3 have by now emptied the storage of the
    # gathered weights they saved, unless they keep them for backward, which is then "gathered".
    for tensor in saved:
        key = _storage_key(tensor)
        nbytes = getattr(tensor, "_local_tensor", tensor).untyped_storage().nbytes()
        if nbytes and key[1] and key not in seen:
            seen.add(key)
            is_param = key in param_keys or isinstance(tensor, torch.nn.Parameter)
            totals["gathered" if is_param or hasattr(tensor, "ds_id") else "activations"] += nbytes
    saved.clear()  # drop the graph's tensors now, not when the caller's frame ends
    del output, loss
    _zero3_release(runnable, zero3_gathered_before)
    return totals["activations"], totals["gathered"], peak


def forward_peak(before: int, counter_before: int, counter_after: int, seen: int) -> int:
    """The most a forward allocated beyond `before`, without resetting torch's peak counter (the
    user's own max_memory_allocated): the counter's when the forward raised it, which is exact;
    else the most `seen` along the way (the counter only says it stayed below its old peak)."""
    return (counter_after if counter_after > counter_before else seen) - before


def _zero3_available(module: Any) -> set[int]:
    """ids of the ZeRO-3 parameters whose full data is on this rank now."""
    return {id(p) for p in module.parameters() if getattr(p, "ds_status", None) is not None
            and p.ds_status.name != "NOT_AVAILABLE"}


def _zero3_release(module: Any, available_before: set[int]) -> None:
    """Partition again the ZeRO-3 parameters the measuring forward gathered.

    With a recorded trace ZeRO-3 keeps what it will reuse within stage3_max_reuse_distance (1e9
    elements by default: every weight of most models) gathered after forward, for a backward that
    never comes here. Releasing only frees the full copy (the shard stays in ds_tensor), so it is
    local to the rank, and the rank's memory is left as the measurement found it.
    """
    for param in module.parameters():
        if (getattr(param, "ds_status", None) is not None and param.ds_status.name == "AVAILABLE"
                and id(param) not in available_before and not param.ds_active_sub_modules):
            param.partition()


def _storage_key(tensor: Any) -> tuple[str, int]:
    local = getattr(tensor, "_local_tensor", tensor)
    return (local.device.type, local.untyped_storage().data_ptr())


def _heap_in_use() -> int | None:
    """glibc's mallinfo2: bytes in use from the heap plus mmapped blocks (None off glibc)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def _rss() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency, but never fail a measurement
        return None

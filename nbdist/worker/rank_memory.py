"""A rank's memory samples (the ``"memory"`` provider) and its `--memory-limit` budget, set inside
the rank after start-up so the notebook, controller and nanny stay unlimited (CPU: the soft
RLIMIT_DATA, docs/FAULTS.md says why)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nbdist.worker.agent import TelemetryAgent


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(None)  # the C library the process runs on
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)  # glibc >= 2.33 only; elsewhere the heap is RSS
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2
    _MALLINFO2.argtypes = []


def read_status(*names: str) -> dict[str, int]:
    """These fields of /proc/self/status (VmRSS, VmHWM, VmData...) in bytes, from one read."""
    prefixes = tuple(f"{name}:".encode() for name in names)
    fields: dict[str, int] = {}
    with open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(prefixes):
                key, value = line.split(b":", 1)
                fields[key.decode()] = int(value.split()[0]) * 1024  # the file says kB
    return fields


def _host_memory_total() -> int:
    """Physical RAM, or the cgroup limit when the container is given less."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and 0 < int(text) < total else total
    return total


class MemorySampler:
    """Byte counts under the same keys on either device (the dashboard draws one kind of bar):
    ``allocated`` (CUDA tensors / CPU heap), ``reserved`` (caching allocator / RSS), ``peak`` (this
    cell's), ``capacity`` (device total / RAM or cgroup limit), ``kind``, ``device``, extras. A
    rank with several GPUs (``others``) reports their sums, each GPU's own under ``"gpus"``."""

    def __init__(self, device: Any = None, others: Sequence[Any] = ()) -> None:
        self.device = device
        self.kind = "cuda" if getattr(device, "type", str(device)).startswith("cuda") else "cpu"
        self._lock = threading.Lock()
        self._cell = -1
        self._capacity = _host_memory_total() if self.kind == "cpu" else None
        self._can_clear_refs = True
        self._sampled_peak = 0
        self._gpus = ([_GpuCounters(device)] + [_GpuCounters(other) for other in others
                                                if str(other) != str(device)]
                      if self.kind == "cuda" else [])

    def sample(self, cell: int | None = None) -> dict[str, Any]:
        """On the main thread (a cell's start and end) a GPU sample is the allocator's counters
        only: NVML is left to the telemetry thread."""
        with self._lock:  # the agent may collect from the main thread and its own at once
            new_cell = cell is not None and cell != self._cell
            if new_cell:
                self._cell = cell
            if self.kind == "cpu":
                return self._sample_cpu(new_cell)
            return self._sample_cuda(new_cell)

    def _sample_cpu(self, cell_start: bool) -> dict[str, Any]:
        if cell_start and self._can_clear_refs:
            try:
                # "5" resets VmHWM to the current RSS (Linux >= 4.0); no other side effect
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                self._can_clear_refs = False
        status = read_status("VmRSS", "VmHWM")
        rss = status.get("VmRSS", 0)
        heap, heap_source = rss, "rss"
        if _MALLINFO2 is not None:
            info = _MALLINFO2()
            heap, heap_source = int(info.uordblks + info.hblkhd), "mallinfo2"  # arenas + mmapped
        # without clear_refs VmHWM is the process-lifetime peak: our own samples then; with it,
        # never less than a sample we saw (the kernel's counters lag a bit)
        self._sampled_peak = rss if cell_start else max(self._sampled_peak, rss)
        peak = status.get("VmHWM", 0) if self._can_clear_refs else 0
        return {"kind": "cpu", "device": "cpu", "allocated": heap, "reserved": rss,
                "peak": max(peak, self._sampled_peak), "capacity": self._capacity, "rss": rss,
                "heap_source": heap_source}

    def _sample_cuda(self, cell_start: bool) -> dict[str, Any]:
        with_nvml = threading.current_thread() is not threading.main_thread()
        gpus = [gpu.sample(cell_start, with_nvml) for gpu in self._gpus]
        if len(gpus) == 1:
            return gpus[0]
        total = {key: sum(gpu[key] for gpu in gpus)
                 for key in ("allocated", "reserved", "peak", "capacity")}
        if all("nvml_used" in gpu for gpu in gpus):
            total.update(nvml_used=sum(gpu["nvml_used"] for gpu in gpus),
                         util=max(gpu["util"] for gpu in gpus))
        return {"kind": "cuda", "device": ",".join(gpu["device"] for gpu in gpus), **total,
                "gpus": gpus}


class _GpuCounters:
    """One GPU's sample: torch's allocator counters, this cell's peak, NVML's figures."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.capacity: int | None = None
        self.sampled_peak = 0
        self.torch_peak_at_start = 0
        self.extras: dict[str, Any] = {}
        self.nvml: Any = None

    def sample(self, cell_start: bool, with_nvml: bool) -> dict[str, Any]:
        import torch

        device = self.device
        if self.capacity is None:
            self.capacity = int(torch.cuda.get_device_properties(device).total_memory)
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        torch_peak = int(stats.get("allocated_bytes.all.peak", 0))
        if cell_start:
            # the cell's peak: what is allocated now, what the samples see, and torch's own peak
            # once the cell pushes it past where it stood when the cell began
            self.sampled_peak, self.torch_peak_at_start = allocated, torch_peak
        self.sampled_peak = max(self.sampled_peak, allocated)
        peak = torch_peak if torch_peak > self.torch_peak_at_start else self.sampled_peak
        if with_nvml:
            self.extras = self._nvml_sample()
        return {"kind": "cuda", "device": str(device), "allocated": allocated,
                "reserved": int(stats.get("reserved_bytes.all.current", 0)), "peak": peak,
                "capacity": self.capacity, **self.extras}

    def _nvml_sample(self) -> dict[str, Any]:
        """Utilisation and what NVML sees used (every process, CUDA contexts included)."""
        if self.nvml is None:
            self.nvml = _open_nvml(self.device)
        nvml, handle = self.nvml
        if handle is None:
            return {}
        try:
            return {"util": int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "nvml_used": int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
                    "nvml_process": nvml_process_memory(nvml, handle, os.getpid())}
        except Exception:
            return {}


def nvml_process_memory(nvml: Any, handle: Any, pid: int) -> int | None:
    """What NVML counts for process `pid` on the device, its CUDA context included (ranks that
    share a GPU each see all of theirs in nvml_used); None where NVML lists it under another
    PID (a container's PID namespace) or not at all."""
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return None
    used = [p.usedGpuMemory for p in running if p.pid == pid and p.usedGpuMemory is not None]
    return int(used[0]) if used else None


def nvml_uuids(torch_uuid: str) -> list[str]:
    """The names NVML may know this device by: torch prints a UUID bare, NVML prefixes a whole
    GPU's with "GPU-" and a MIG instance's with "MIG-"."""
    bare = torch_uuid.strip()
    if bare.startswith(("GPU-", "MIG-")):
        return [bare]
    return [f"GPU-{bare}", f"MIG-{bare}"] if bare else []


def physical_index(index: int, visible: str | None) -> int | None:
    """NVML's index of torch's device `index` under CUDA_VISIBLE_DEVICES `visible`; None when
    the list names devices by UUID (or MIG instance): no index can be trusted then."""
    ids = [part.strip() for part in (visible or "").split(",") if part.strip()]
    if not ids:
        return index
    if index >= len(ids) or not all(part.isdigit() for part in ids):
        return None
    return int(ids[index])


def _open_nvml(device: Any) -> tuple[Any, Any]:
    """(pynvml, the handle of this rank's device), or (None, None)."""
    try:
        import pynvml  # provided by nvidia-ml-py
        import torch

        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        # torch indexes are relative to CUDA_VISIBLE_DEVICES; NVML's are physical: match by UUID
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        for name in nvml_uuids(uuid):
            for form in (name.encode(), name):  # older bindings want bytes
                with contextlib.suppress(Exception):
                    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(form)
        physical = physical_index(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if physical is None:
            return None, None  # better no NVML figures than another GPU's
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(physical)
    except Exception:  # no pynvml, no driver
        return None, None


def install_memory_sampler(agent: TelemetryAgent, device: Any = None,
                           others: Sequence[Any] = ()) -> MemorySampler:
    sampler = MemorySampler(device, others)
    agent.register("memory", lambda: sampler.sample(agent.cell_id))
    return sampler


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

STATE: dict[str, Any] = {}  # what apply_memory_limit did: mechanism, limit, baseline...


def apply_memory_limit(limit: int | None, device: Any, others: Sequence[Any] = ()) -> None:
    """Cap what this rank may allocate from now on at `limit` bytes (None: unlimited); on GPU,
    on each of its GPUs (`device` and `others`): torch's cap is one per device."""
    if limit is None:
        return
    import torch

    STATE.clear()
    if getattr(device, "type", "cpu") == "cuda":
        gpus = [device] + [other for other in others if str(other) != str(device)]
        for gpu in gpus:
            total = torch.cuda.get_device_properties(gpu).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), gpu)
        STATE.update(mechanism="cuda memory fraction", limit=limit, baseline=0, device=device,
                     gpus=gpus)
        return
    with contextlib.suppress(AttributeError):  # not glibc
        # glibc: every block of 128 KiB or more its own mmap, unmapped when freed; by default the
        # threshold rises after the first large free and freed tensors stay counted in the heap
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    # OpenMP starts intra-op threads on first use and each stack (8 MiB) counts as data: start
    # them before the budget, or libgomp's thread creation fails under a small one on many cores
    torch.ones(torch.get_num_threads() * 2**15).add_(1)  # 2**15: at::parallel_for's grain size
    baseline = read_status("VmData")["VmData"]  # private writable mappings: what the limit counts
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = baseline + limit if hard == resource.RLIM_INFINITY else min(baseline + limit, hard)
    # the soft limit only: the rank (or nbdist) may lift it again; a budget, not a sandbox
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    STATE.update(mechanism="RLIMIT_DATA", limit=limit, baseline=baseline, soft_limit=soft)


def memory_budget() -> dict[str, Any]:
    """This rank's limit and how much of it is in use (CPU: VmData beyond the start-up baseline;
    GPU: what the cap counts, torch.cuda.memory_reserved, and allocated, on its fullest GPU)."""
    if not STATE:
        return {"limit": None, "in_use": None}
    budget = {"limit": STATE["limit"], "mechanism": STATE["mechanism"]}
    if STATE["mechanism"] == "RLIMIT_DATA":
        return {**budget, "in_use": read_status("VmData")["VmData"] - STATE["baseline"]}
    import torch

    # each GPU has its own cap: the fullest one is the rank's
    fullest = max(STATE["gpus"], key=torch.cuda.memory_reserved)
    return {**budget, "in_use": torch.cuda.memory_reserved(fullest),
            "allocated": torch.cuda.memory_allocated(fullest)}


@contextlib.contextmanager
def lifted() -> Iterator[None]:
    """The CPU budget lifted while nbdist itself works inside the rank: formatting the very error
    that hit the limit needs memory too."""
    if STATE.get("mechanism") != "RLIMIT_DATA":
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

"""Per-rank memory samples for the dashboard: CUDA allocator + NVML on GPU, heap/RSS/peak on CPU.

Registered as the telemetry agent's ``"memory"`` provider, so it runs on the telemetry thread every
tick and at each cell's start and end. The per-cell peak on GPU is nbdist's own: torch's peak
counters stay the user's (``torch.cuda.max_memory_allocated()`` counts from where they reset it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from typing import Any

from nbdist.worker.agent import TelemetryAgent


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@functools.cache
def libc() -> Any:
    """The C library, loaded once (find_library runs ldconfig); OSError where there is none."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _load_mallinfo2() -> Any:
    # glibc >= 2.33 only; musl and macOS lack it and fall back to RSS
    try:
        fn = libc().mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


def read_status(*names: str) -> dict[str, int]:
    """These fields of /proc/self/status (VmRSS, VmHWM, VmData...) in bytes, from one read of
    the file (its values are kB); OSError off Linux."""
    prefixes = tuple(f"{name}:".encode() for name in names)
    fields: dict[str, int] = {}
    with open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(prefixes):
                key, value = line.split(b":", 1)
                fields[key.decode()] = int(value.split()[0]) * 1024
    return fields


def _host_memory_total() -> int:
    """Physical RAM, or the cgroup limit when the container is given less."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as limit_file:
                text = limit_file.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
        break
    return total


class MemorySampler:
    """Samples one rank's memory; ``sample()`` returns a flat dict of byte counts.

    Keys, for both device kinds (so the dashboard draws one kind of bar):
    ``allocated`` (CUDA tensors / CPU heap in use), ``reserved`` (CUDA caching allocator / RSS),
    ``peak`` (max allocated this cell / RSS high-water mark this cell), ``capacity`` (device total /
    RAM or cgroup limit), plus ``kind``, ``device`` and kind-specific extras (``util``, ``nvml_used``,
    ``rss``, ``alloc_retries``, ``heap_source``).
    """

    def __init__(self, device: Any = None, reset_peak_per_cell: bool = True) -> None:
        self.device = device
        self.kind = "cuda" if getattr(device, "type", str(device)).startswith("cuda") else "cpu"
        self.reset_peak_per_cell = reset_peak_per_cell
        self._lock = threading.Lock()
        self._cell = -1
        self._capacity: int | None = None
        self._mallinfo2 = _load_mallinfo2() if self.kind == "cpu" else None
        self._can_clear_refs = True
        self._sampled_peak = 0
        self._torch_peak_at_start = 0
        self._device_extras: dict[str, Any] = {}
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self._nvml_tried = False

    # -- providers -----------------------------------------------------------------------------
    def sample(self, cell: int | None = None) -> dict[str, Any]:
        """One sample. On the main thread (a cell's start and end) a GPU sample is the
        allocator's counters only: the driver and NVML calls are left to the telemetry thread."""
        with self._lock:  # the agent may collect from the main thread and its own at once
            new_cell = cell is not None and cell != self._cell
            if new_cell:
                self._cell = cell
                if self.reset_peak_per_cell and self.kind == "cpu":
                    self._reset_cpu_peak()
            if self.kind == "cuda":
                light = threading.current_thread() is threading.main_thread()
                return self._sample_cuda(new_cell and self.reset_peak_per_cell, light)
            return self._sample_cpu()

    def _reset_cpu_peak(self) -> None:
        self._sampled_peak = 0
        if self._can_clear_refs:
            try:
                # "5" resets VmHWM to the current RSS (Linux >= 4.0); no other side effect
                with open("/proc/self/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")
            except OSError:
                self._can_clear_refs = False

    def _sample_cpu(self) -> dict[str, Any]:
        status = read_status("VmRSS", "VmHWM")
        rss = status.get("VmRSS", 0)
        if self._mallinfo2 is not None:
            info = self._mallinfo2()
            heap = int(info.uordblks + info.hblkhd)  # small-block arenas + mmapped big blocks
            heap_source = "mallinfo2"
        else:
            heap, heap_source = rss, "rss"
        # without clear_refs VmHWM is the process-lifetime peak: fall back to our own samples.
        # With it, still never report less than a sample we saw (the kernel's counters lag a bit).
        self._sampled_peak = max(self._sampled_peak, rss)
        peak = status.get("VmHWM", 0) if self._can_clear_refs else 0
        if self._capacity is None:
            self._capacity = _host_memory_total()
        return {
            "kind": "cpu",
            "device": "cpu",
            "allocated": heap,
            "reserved": rss,
            "peak": max(peak, self._sampled_peak),
            "capacity": self._capacity,
            "rss": rss,
            "heap_source": heap_source,
        }

    def _sample_cuda(self, cell_start: bool, light: bool) -> dict[str, Any]:
        import torch

        device = self.device
        if self._capacity is None:
            self._capacity = int(torch.cuda.get_device_properties(device).total_memory)
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        torch_peak = int(stats.get("allocated_bytes.all.peak", 0))
        if cell_start:
            # the cell's peak: what is allocated now, what the samples see, and torch's own peak
            # once the cell pushes it past where it stood when the cell began
            self._sampled_peak, self._torch_peak_at_start = allocated, torch_peak
        self._sampled_peak = max(self._sampled_peak, allocated)
        peak = torch_peak if torch_peak > self._torch_peak_at_start else self._sampled_peak
        sample: dict[str, Any] = {
            "kind": "cuda",
            "device": str(device),
            "allocated": allocated,
            "reserved": int(stats.get("reserved_bytes.all.current", 0)),
            "peak": peak,
            "capacity": self._capacity,
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "inactive_split": int(stats.get("inactive_split_bytes.all.current", 0)),
        }
        if light:
            sample.update(self._device_extras)  # the telemetry thread's latest
            return sample
        free, total = torch.cuda.mem_get_info(device)
        # every process on the card, CUDA contexts included
        self._device_extras = {"device_used": int(total - free), **(self._nvml_sample() or {})}
        sample.update(self._device_extras)
        return sample

    # -- NVML (optional) -----------------------------------------------------------------------
    def _nvml_sample(self) -> dict[str, Any] | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            self._nvml, self._nvml_handle = _open_nvml(self.device)
        if self._nvml_handle is None:
            return None
        nvml, handle = self._nvml, self._nvml_handle
        try:
            out: dict[str, Any] = {
                "util": int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                "nvml_used": int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
            }
            pid = os.getpid()
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                # what this process holds beyond PyTorch's allocator (context, cuBLAS workspaces);
                # absent in containers whose PID namespace NVML cannot see
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    out["nvml_process_used"] = int(proc.usedGpuMemory)
            return out
        except Exception:
            return None


def nvml_uuids(torch_uuid: str) -> list[str]:
    """The names NVML may know this device by: torch prints a UUID bare, NVML prefixes a whole
    GPU's with "GPU-" and a MIG instance's with "MIG-"."""
    bare = torch_uuid.strip()
    for prefix in ("GPU-", "MIG-"):
        if bare.startswith(prefix):
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
    try:
        import pynvml  # provided by nvidia-ml-py
        import torch
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        # torch indexes are relative to CUDA_VISIBLE_DEVICES; NVML's are physical: match by UUID
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
        for name in nvml_uuids(uuid):
            for form in (name.encode(), name):  # older bindings want bytes
                try:
                    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(form)
                except Exception:
                    continue
        physical = physical_index(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if physical is None:
            return None, None  # better no NVML figures than another GPU's
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(physical)
    except Exception:
        return None, None


def install_memory_sampler(agent: TelemetryAgent, device: Any = None) -> MemorySampler | None:
    """Register the ``"memory"`` provider on this rank's agent (never raises; None if it cannot)."""
    try:
        sampler = MemorySampler(device)
        agent.register("memory", lambda: sampler.sample(agent.cell_id))
        return sampler
    except Exception as exc:  # the dashboard is optional: a rank must come up without it
        agent.provider_errors["memory"] = repr(exc)
        return None

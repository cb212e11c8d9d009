"""Per-rank memory samples for the dashboard: CUDA allocator + NVML on GPU, heap/RSS/peak on CPU.

Registered as the telemetry agent's ``"memory"`` provider, so it runs on the telemetry thread every
tick and at each cell's start and end; the peak is reset at the start of every cell.
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
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self._nvml_tried = False

    # -- providers -----------------------------------------------------------------------------
    def sample(self, cell: int | None = None) -> dict[str, Any]:
        with self._lock:  # the agent may collect from the main thread and its own at once
            if cell is not None and cell != self._cell:
                self._cell = cell
                if self.reset_peak_per_cell:
                    self._reset_peak()
            if self.kind == "cuda":
                return self._sample_cuda()
            return self._sample_cpu()

    def _reset_peak(self) -> None:
        self._sampled_peak = 0
        if self.kind == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
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

    def _sample_cuda(self) -> dict[str, Any]:
        import torch

        device = self.device
        if self._capacity is None:
            self._capacity = int(torch.cuda.get_device_properties(device).total_memory)
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        sample: dict[str, Any] = {
            "kind": "cuda",
            "device": str(device),
            "allocated": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved": int(stats.get("reserved_bytes.all.current", 0)),
            "peak": int(stats.get("allocated_bytes.all.peak", 0)),
            "capacity": int(total),
            "device_used": int(total - free),  # every process on the card, CUDA contexts included
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "inactive_split": int(stats.get("inactive_split_bytes.all.current", 0)),
        }
        nvml = self._nvml_sample()
        if nvml:
            sample.update(nvml)
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
        if uuid:
            target = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            try:
                return pynvml, pynvml.nvmlDeviceGetHandleByUUID(target.encode())
            except Exception:
                try:
                    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(target)
                except Exception:
                    pass
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if ids and ids[index].isdigit():
            index = int(ids[index])
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
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

"""The rank's device for a rank's threads other than its main one (telemetry, the release thread's
reports): bound once per thread before its first CUDA call, as torch's own side threads do."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any

from nbdist.strategies._common import RANK_DEVICE_VAR

# A new thread's current CUDA device is 0 until it sets one: its first CUDA call would make a
# context there, on a GPU the rank does not own (torch's CUDAEvent guards its device in
# elapsed_time and its destructor for this; torchcomms' watchdog sets its device first). torch's
# DataLoader pin-memory thread sets the device once at its start; so does this.
#
# A thread's capture mode decides whether a CUDA graph that another thread captures forbids its
# event queries ("operation not permitted when stream is capturing", and the capture is spoilt).
# torch's NCCL watchdog queries its events in thread-local mode; torch has no Python binding for
# it, so the driver's own call sets it, once, for the whole thread.
_CAPTURE_MODE_THREAD_LOCAL = 1  # cuda.h: CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_DRIVER_LIBRARY = "libcuda.so.1"

_LOCAL = threading.local()
BOUND: dict[str, str] = {}
"""Thread name -> what that thread was bound to ("cuda:N", or "cpu" on a rank without a GPU)."""


def cuda_index(device: Any) -> int | None:
    """The CUDA index of a rank's device (``cuda:N``, an index or None); None for the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def bind_thread(device: Any = None) -> str:
    """Make the rank's `device` (None: the one the rank was pinned to, the CPU outside a rank)
    the calling thread's CUDA device and its capture mode thread-local, once per thread; what
    the thread is bound to. The main thread is the user's: left alone ("main")."""
    if threading.current_thread() is threading.main_thread():
        return "main"
    bound = getattr(_LOCAL, "bound", None)
    if bound is not None:
        return bound
    index = cuda_index(os.environ.get(RANK_DEVICE_VAR) if device is None else device)
    bound = "cpu" if index is None else f"cuda:{index}"
    if index is not None:
        import torch

        try:
            torch.cuda.set_device(index)
            if not set_thread_local_capture_mode():
                bound = f"{bound} (capture mode unchanged)"
        except Exception as error:  # the thread still reports; its CUDA calls may fail instead
            bound = f"{bound} refused ({type(error).__name__}: {error})"
    _LOCAL.bound = bound
    BOUND[threading.current_thread().name] = bound
    return bound


@functools.cache
def _driver() -> Any:
    """The CUDA driver library (one per process, whichever runtime torch links), or None."""
    try:
        return ctypes.CDLL(_DRIVER_LIBRARY)
    except OSError:
        return None


def set_thread_local_capture_mode() -> bool:
    """This thread's CUDA graph capture mode made thread-local (the driver's
    cuThreadExchangeStreamCaptureMode, which needs no context); False without a driver."""
    driver = _driver()
    if driver is None:
        return False
    mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
    return int(driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))) == 0


def capture_mode() -> int | None:
    """This thread's capture mode (0 global, 1 thread-local, 2 relaxed), read by swapping it out
    and back; None without a driver."""
    driver = _driver()
    if driver is None:
        return None
    mode = ctypes.c_int(0)
    if int(driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))) != 0:
        return None
    previous = mode.value
    driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))  # puts `previous` back
    return previous

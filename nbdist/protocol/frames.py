"""Values pushed to and pulled from ranks as message frames: pickle protocol 5, every tensor on the
CPU for the trip, a large one's memory a frame of its own (neither side copies it into a pickle)."""

from __future__ import annotations

import functools
import io
import pickle
import sys
from typing import Any

OUT_OF_BAND = 64 * 1024
"""Tensors from this many bytes travel as their own frame (zmq sends those without a copy)."""


class CellClassMissing(AttributeError):
    """The pickle names a class or function defined in a cell (`__main__`) this process lacks."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} is defined in a cell where the value was made, not here: run "
                         "the same definition here too")
        self.name = name


def pack(value: Any) -> list[Any]:
    """`value` as frames: a pickle and one frame per large tensor (a CPU tensor's own memory).
    A tensor on a GPU is copied to the CPU: the notebook never touches a device."""
    frames: list[Any] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool | None:
        if buffer.raw().nbytes < OUT_OF_BAND:
            return True  # in the pickle
        frames.append(buffer)
        return None

    head = io.BytesIO()
    _FramePickler(head, protocol=5, buffer_callback=out_of_band).dump(value)
    return [head.getvalue(), *(frame.raw() for frame in frames)]


def unpack(frames: list[Any], device: Any = None) -> Any:
    """The value `pack` made, its tensors moved to `device` if given (a tensor frame received
    without a copy and left on the CPU stays shared with it)."""
    queued = len(_sparse_to_validate())
    try:
        return _Unpickler(io.BytesIO(frames[0]), buffers=frames[1:], device=device).load()
    finally:
        # torch's own unpickling queues each sparse tensor for the next torch.load to validate
        # (torch 2.6 does): ours come from the cluster's signed ranks, and would stay held there
        del _sparse_to_validate()[queued:]


def _sparse_to_validate() -> list[Any]:
    """torch's queue of unpickled sparse tensors; empty while torch is not imported."""
    utils = sys.modules.get("torch._utils")
    return utils._sparse_tensors_to_validate if utils is not None else []


class _FramePickler(pickle.Pickler):
    _plain: Any = None  # a tensor handed to torch's own pickling

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # not imported: no tensor here, and no 2 s import
        if torch is None or not isinstance(obj, torch.Tensor) or obj is self._plain:
            return NotImplemented
        flags = (obj.requires_grad, isinstance(obj, torch.nn.Parameter))
        if (type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided
                or obj.is_quantized):  # sparse, quantized, a subclass: torch pickles it, on CPU
            self._plain = obj.detach().cpu()
            return _placed, (self._plain, *flags)
        data = obj.detach().cpu().resolve_conj().resolve_neg().contiguous()
        data = data.reshape(-1).view(torch.uint8).numpy()
        return _tensor, (pickle.PickleBuffer(data), str(obj.dtype), tuple(obj.shape), *flags)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: list[Any], device: Any) -> None:
        super().__init__(file, buffers=buffers)
        self.device = device

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = super().find_class(module, name)
        except AttributeError:
            if module == "__main__":
                raise CellClassMissing(name) from None
            raise
        if found in (_tensor, _placed):
            return functools.partial(found, device=self.device)
        return found


def _tensor(data: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
            parameter: bool, device: Any = None) -> Any:
    import numpy
    import torch

    kind = getattr(torch, dtype.removeprefix("torch."))
    if memoryview(data).readonly:  # received as bytes: torch must not write into those
        data = bytearray(data)
    # numpy takes an empty buffer too (torch.frombuffer refuses one)
    tensor = torch.from_numpy(numpy.frombuffer(data, numpy.uint8)).view(kind).reshape(shape)
    return _placed(tensor, requires_grad, parameter, device)


def _placed(tensor: Any, requires_grad: bool, parameter: bool, device: Any = None) -> Any:
    import torch

    if device is not None:
        tensor = tensor.to(device)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)

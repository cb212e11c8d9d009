"""Values pushed to and pulled from ranks as message frames: pickle protocol 5 with every large CPU
tensor's memory as a frame of its own, so neither side copies it into a pickle."""

from __future__ import annotations

import io
import pickle
from typing import Any

OUT_OF_BAND = 64 * 1024
"""Tensors from this many bytes travel as their own frame (zmq sends those without a copy)."""


def pack(value: Any) -> list[Any]:
    """`value` as frames: a pickle and one frame per large CPU tensor (the tensor's own memory)."""
    frames: list[Any] = []
    head = io.BytesIO()
    _FramePickler(head, frames.append).dump(value)
    return [head.getvalue(), *(frame.raw() for frame in frames)]


def unpack(frames: list[Any]) -> Any:
    """The value `pack` made; a tensor frame received without a copy stays shared with it."""
    return pickle.loads(frames[0], buffers=frames[1:])


class _FramePickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, on_frame: Any) -> None:
        super().__init__(file, protocol=5, buffer_callback=on_frame)

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if (type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu"
                or obj.layout != torch.strided or obj.is_quantized
                or obj.numel() * obj.element_size() < OUT_OF_BAND):
            return NotImplemented
        data = obj.detach().resolve_conj().resolve_neg().contiguous()
        data = data.reshape(-1).view(torch.uint8).numpy()
        flags = (obj.requires_grad, type(obj) is torch.nn.Parameter)
        return _tensor, (pickle.PickleBuffer(data), str(obj.dtype), tuple(obj.shape), *flags)


def _tensor(data: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
            parameter: bool) -> Any:
    import torch

    if memoryview(data).readonly:  # received as bytes: torch must not write into those
        data = bytearray(data)
    kind = getattr(torch, dtype.removeprefix("torch."))
    tensor = torch.frombuffer(data, dtype=torch.uint8).view(kind).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)

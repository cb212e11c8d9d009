"""Values crossing between the notebook and a rank (%dist_push, %dist_pull): every tensor inside
them moved to one device, wherever it sits (dicts, lists, namedtuples, dataclasses, attributes of
any picklable object)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import types
from typing import Any


def move_tensors(value: Any, device: Any) -> Any:
    """`value` with every tensor in it on `device` (a copy where any had to move). A tensor
    left on CUDA inside a pulled object would initialise CUDA in the notebook, or fail there."""
    import torch

    target = torch.device(device)
    if isinstance(value, torch.Tensor):
        return _moved(value, target)
    if not _holds_tensor_elsewhere(value, target):
        return value
    buffer = io.BytesIO()
    try:
        _MovingPickler(buffer, target).dump(value)
    except (pickle.PicklingError, TypeError, AttributeError):
        # a class defined in a cell or a lambda inside: not picklable by reference here
        return _walk(value, target, {})
    return pickle.loads(buffer.getvalue())


_NOT_COPIED = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
               types.ModuleType)


def _walk(value: Any, target: Any, memo: dict[int, Any]) -> Any:
    """`value` rebuilt with its tensors moved: containers by type, other objects copied with
    their attributes walked (what the pickler could not do)."""
    import torch

    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        moved = _moved(value, target)
        if isinstance(value, torch.nn.Parameter) and moved is not value:
            moved = _parameter(moved, value.requires_grad)
    elif type(value) is dict:
        moved = {key: _walk(item, target, memo) for key, item in value.items()}
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        moved = type(value)(*(_walk(item, target, memo) for item in value))
    elif type(value) in (list, tuple, set, frozenset):
        moved = type(value)(_walk(item, target, memo) for item in value)
    elif hasattr(value, "__dict__") and not isinstance(value, _NOT_COPIED):
        moved = copy.copy(value)
        for name, item in vars(value).items():
            object.__setattr__(moved, name, _walk(item, target, memo))
    else:
        moved = value
    memo[id(value)] = moved
    return moved


def _moved(tensor: Any, target: Any) -> Any:
    return tensor if tensor.device == target else tensor.detach().to(target)


def _holds_tensor_elsewhere(value: Any, target: Any) -> bool:
    """A cheap first look: plain numbers, strings and containers of them need no copy."""
    import torch

    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return False
    if isinstance(value, torch.Tensor):
        return value.device != target
    if isinstance(value, dict) and not type(value).__module__.startswith("collections"):
        return any(_holds_tensor_elsewhere(v, target) for v in value.values())
    if type(value) in (list, tuple, set, frozenset):
        return any(_holds_tensor_elsewhere(v, target) for v in value)
    return True  # an object, a namedtuple, a dataclass: let the pickler look inside


class _MovingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, target: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.target = target

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.nn.Parameter) and obj.device != self.target:
            return _parameter, (_moved(obj, self.target), obj.requires_grad)
        if isinstance(obj, torch.Tensor) and obj.device != self.target:
            return _identity, (_moved(obj, self.target),)
        return NotImplemented


def cell_classes(value: Any) -> set[str]:
    """The classes and functions defined in a cell (module `__main__`) that a pickle of `value`
    would name: another process rebuilds them only if its own `__main__` has them too."""
    found: set[str] = set()
    with open(os.devnull, "wb") as sink, contextlib.suppress(Exception):
        _CellClassFinder(sink, found).dump(value)  # unpicklable: packing the reply reports it
    return found


class _CellClassFinder(pickle.Pickler):
    """Pickles nothing but the structure (tensors are skipped) and notes `__main__` names."""

    def __init__(self, file: Any, found: set[str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found = found

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            return _identity, (None,)
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            self.found.add(obj.__qualname__)
        return NotImplemented


def _identity(value: Any) -> Any:
    return value


def _parameter(data: Any, requires_grad: bool) -> Any:
    import torch

    return torch.nn.Parameter(data, requires_grad=requires_grad)


def receive_values(values: dict[str, Any]) -> list[str]:
    """Push: bind names in the rank's namespace, tensors moved to the rank's device."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    device = namespace.get("device")
    namespace.update({name: value if device is None else move_tensors(value, device)
                      for name, value in values.items()})
    return sorted(values)


def send_values(names: list[str], loadable: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Pull: the named values, tensors moved to CPU. `loadable`: the classes the notebook's
    `__main__` has; a value naming another cell-defined class is refused here, with the fix,
    since the notebook could not unpickle it."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    missing = [name for name in names if name not in namespace]
    if missing:
        raise NameError(f"not defined on this rank: {', '.join(missing)}")
    values = {name: move_tensors(namespace[name], "cpu") for name in names}
    unknown = sorted(cell_classes(values) - set(loadable))
    if unknown:
        raise TypeError(
            f"the value holds {', '.join(unknown)}, defined in a cell on the ranks, which the "
            "notebook does not define: it could not rebuild the value. Run the same definition "
            "in a plain notebook cell too, or pull plain types (dicts, lists, tuples, tensors).")
    return values

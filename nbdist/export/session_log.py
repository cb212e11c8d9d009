"""What a notebook session did that IPython's history does not hold: the values ``%dist_push``
sent (as source that rebuilds them, where plain data allows) and the cells that failed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_LITERAL_LIMIT = 20_000
"""Longest literal (characters) written for a pushed value; longer ones become placeholders."""

_MAX_LITERAL_DEPTH = 20
"""Deepest nesting of containers written out as a literal (deeper: a placeholder)."""

FAILURE_LINE_LIMIT = 200
"""Longest one-line failure description (characters) kept for a cell."""


@dataclass
class PushedValue:
    """One name that ``%dist_push`` bound on every rank."""

    name: str
    source: str | None
    """Python source that rebuilds the value (None: it has none, e.g. a tensor or a model)."""

    description: str
    """What the value was, for the placeholder, e.g. ``a Tensor of shape (3, 4), torch.float32``."""

    @classmethod
    def of(cls, name: str, value: Any) -> PushedValue:
        source = _literal(value)
        if source is not None and len(source) > _LITERAL_LIMIT:
            too_large = f"{_describe(value)}, too large to write out ({len(source)} characters)"
            return cls(name, None, too_large)
        return cls(name, source, _describe(value))


@dataclass
class SessionLog:
    """What IPython's history does not hold, by cell label (``In[7]``): the values ``%dist_push``
    sent, and the cells that failed. The magics fill it; :func:`script_steps` reads it."""

    pushes: dict[str, list[PushedValue]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    """label -> why the cell failed (a rank raised, timed out, was interrupted...)."""

    pending: list[PushedValue] = field(default_factory=list)
    """Pushes of the cell running now; filed under its label when it finishes."""

    def record_push(self, values: Mapping[str, Any]) -> None:
        """``%dist_push`` succeeded: remember the values as they were sent."""
        self.pending.extend(PushedValue.of(name, value) for name, value in values.items())

    def cell_finished(self, result: Any) -> None:
        """IPython's ``post_run_cell`` event: file the cell's pushes and failure under ``In[n]``.

        Hooked on the event rather than computed in the magics because IPython versions differ
        on when ``execution_count`` moves on; the result carries the cell's own number."""
        info = getattr(result, "info", None)
        count = getattr(result, "execution_count", None)
        if count is None or not getattr(info, "store_history", False):
            return  # not in the history, so the export will not see this cell either
        label = f"In[{count}]"
        if self.pending:
            self.pushes.setdefault(label, []).extend(self.pending)
            self.pending = []
        error = getattr(result, "error_before_exec", None) or getattr(result, "error_in_exec", None)
        if error is not None:
            self.failures[label] = describe_failure(error)

    def clear(self) -> None:
        self.pushes.clear()
        self.failures.clear()
        self.pending.clear()


def describe_failure(error: BaseException) -> str:
    """One line: the first rank's own error for a distributed cell, else the exception."""
    result = getattr(error, "result", None)
    if result is not None and hasattr(result, "root_causes"):
        causes = result.root_causes()
        if causes:
            more = f" (+{len(causes) - 1} more)" if len(causes) > 1 else ""
            return f"{causes[0].headline()}{more}"
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    if len(line) <= FAILURE_LINE_LIMIT:
        return line
    return line[: FAILURE_LINE_LIMIT - 3] + "..."


def _literal(value: Any, depth: int = 0) -> str | None:
    """Python source for plain data (exact builtin types only), else None."""
    if depth > _MAX_LITERAL_DEPTH:
        return None
    kind = type(value)
    if value is None or kind in (bool, int, str, bytes):
        return repr(value)
    if kind is float:
        return repr(value) if math.isfinite(value) else f'float("{value}")'
    if kind is complex:
        return repr(value) if math.isfinite(value.real) and math.isfinite(value.imag) else None
    if kind in (list, tuple, set, frozenset):
        return _container_literal(value, depth)
    if kind is dict:
        pairs = [(_literal(k, depth + 1), _literal(v, depth + 1)) for k, v in value.items()]
        if any(k is None or v is None for k, v in pairs):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    if kind.__module__ == "torch" and kind.__name__ == "dtype":
        return repr(value)  # torch.float32: the script imports torch
    if kind.__module__ == "torch" and kind.__name__ == "device":
        return f"torch.device({str(value)!r})"
    return None


def _container_literal(value: list | tuple | set | frozenset, depth: int) -> str | None:
    kind = type(value)
    items = [_literal(item, depth + 1) for item in value]
    if any(item is None for item in items):
        return None
    inner = ", ".join(item for item in items if item is not None)
    if kind is list:
        return f"[{inner}]"
    if kind is tuple:
        return f"({inner},)" if len(items) == 1 else f"({inner})"
    if not items:
        return f"{kind.__name__}()"
    return f"{{{inner}}}" if kind is set else f"frozenset({{{inner}}})"


def _describe(value: Any) -> str:
    kind = type(value)
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        try:
            return f"a {kind.__name__} of shape {tuple(shape)}, {value.dtype}"
        except TypeError:
            pass
    if kind.__module__ == "builtins":
        sized = f" of {len(value)} item(s)" if hasattr(value, "__len__") else ""
        name = f"{kind.__name__}{sized}"
    else:
        name = f"{kind.__module__}.{kind.__qualname__}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"

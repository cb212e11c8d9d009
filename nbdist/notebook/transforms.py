"""The input transformers nbdist adds to IPython, which see a cell before it runs: `%autodist`'s,
which makes every cell a `%%distributed` one, and the syntax check of a `%%distributed` cell."""

from __future__ import annotations

from typing import Any

from nbdist.cells.syntax import check_syntax


def _autodist(lines: list[str]) -> list[str]:
    first = next((ln for ln in lines if ln.strip()), "")
    magic_or_shell = not first or first.lstrip().startswith(("%", "!"))
    return lines if magic_or_shell else ["%%distributed\n", *lines]


def _syntax(lines: list[str]) -> list[str]:
    """A `%%distributed` cell whose body does not parse raises its SyntaxError here, while
    IPython prepares the cell, so IPython shows it as it shows a local one: the caret block, none
    of the frames that would have run the magic. Every other cell passes unchanged."""
    if lines and lines[0].split(maxsplit=1)[:1] == ["%%distributed"]:
        check_syntax("".join(lines[1:]))
    return lines


# IPython's check_complete skips it: a cell still being typed is incomplete, not wrong
_syntax.has_side_effects = True  # type: ignore[attr-defined]


def install(shell: Any) -> None:
    """The syntax check, after IPython's own clean-up (blank lines and prompts removed)."""
    if _syntax not in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.append(_syntax)


def uninstall(shell: Any) -> None:
    for transform in (_autodist, _syntax):
        if transform in shell.input_transformers_cleanup:
            shell.input_transformers_cleanup.remove(transform)


def set_autodist(shell: Any, on: bool) -> None:
    """`%autodist on|off`. On, it runs before the syntax check, which then sees the magic."""
    transformers = shell.input_transformers_cleanup
    if _autodist in transformers:
        transformers.remove(_autodist)
    if on:
        at = transformers.index(_syntax) if _syntax in transformers else len(transformers)
        transformers.insert(at, _autodist)

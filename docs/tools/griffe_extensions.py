"""Griffe extensions for the API reference: each magic's docstring gains the usage and options
IPython prints for ``%dist_start?``; Sphinx roles (:class:`X`) in docstrings show as code."""

from __future__ import annotations

import importlib
import re
from typing import Any

import griffe

MAGICS_CLASS = "nbdist.notebook.magics.DistMagics"
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":`" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)


class MagicUsage(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if func.parent is None or func.parent.path != MAGICS_CLASS or func.docstring is None:
            return
        module, _, name = MAGICS_CLASS.rpartition(".")
        method = getattr(getattr(importlib.import_module(module), name), func.name, None)
        help_text = getattr(method, "__doc__", None) or ""
        if not help_text.startswith("::"):  # no magic_arguments: the docstring is all there is
            return
        summary = func.docstring.value.strip()
        # the help text is "::", the usage, the docstring, then the options
        usage = help_text.removeprefix("::").replace(summary, "").strip("\n")
        lines = [line[2:] if line.startswith("  ") and not line.startswith("   ") else line
                 for line in usage.splitlines()]
        func.docstring = griffe.Docstring(
            summary + "\n\n```text\n" + "\n".join(lines).strip("\n") + "\n```", parent=func)


class OptionTables(griffe.Extension):
    """A strategy's options class (`DDPOptions`, ...: a dataclass whose fields carry their own
    docstrings) gets a Parameters section built from those fields, which mkdocstrings draws as
    one table of name, type, description and default: the options `prepare` takes."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if not (cls.path.startswith("nbdist.strategies.") and cls.name.endswith("Options")):
            return
        rows = []
        for name, member in cls.members.items():
            if member.is_attribute and not name.startswith("_") and member.docstring is not None:
                described = " ".join(member.docstring.value.split())
                annotation = f" ({member.annotation})" if member.annotation is not None else ""
                rows.append(f"    {name}{annotation}: {described}")
        if not rows:
            return
        summary = cls.docstring.value.strip() if cls.docstring is not None else ""
        cls.docstring = griffe.Docstring(
            f"{summary}\n\nParameters:\n" + "\n".join(rows), parent=cls)

"""``tqdm.auto`` in a rank picks the console bar, which the notebook shows as one bar per rank.

A rank is an IPython kernel with ipywidgets, so ``tqdm.auto`` would pick the widget bar. That bar
works (a rank's widgets reach the notebook: ``nbdist.cells.widgets``), and ``tqdm.notebook``
gives it to whoever asks for it; but N ranks' widget bars say nothing of which rank drew them,
and a notebook saved without its widget state, or run headless, shows none of them. The console
bar redraws a line with ``\\r`` on stderr, which ``nbdist.notebook.progress`` turns into one
text display per rank, updated in place and kept in the saved notebook. A finder answers the
import of ``tqdm.autonotebook`` (what ``tqdm.auto`` imports) lazily: nothing is imported until
the user imports tqdm.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

AUTO_MODULES = ("tqdm.autonotebook", "tqdm.auto")


class _ConsoleTqdm(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "tqdm.autonotebook":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        from tqdm.std import tqdm, trange

        module.tqdm, module.trange = tqdm, trange  # type: ignore[attr-defined]
        module.__all__ = ["tqdm", "trange"]  # type: ignore[attr-defined]


def install() -> None:
    """Make ``tqdm.auto`` the console bar in this process (never raises)."""
    try:
        if not any(isinstance(finder, _ConsoleTqdm) for finder in sys.meta_path):
            sys.meta_path.insert(0, _ConsoleTqdm())
        if any(name in sys.modules for name in AUTO_MODULES):  # imported before the rank's setup
            from tqdm.std import tqdm, trange

            for name in AUTO_MODULES:
                module = sys.modules.get(name)
                if module is not None:
                    module.tqdm, module.trange = tqdm, trange  # type: ignore[attr-defined]
    except Exception:
        pass


def uninstall() -> None:
    """Let ``tqdm.auto`` choose by itself again in modules imported from now on (tests)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _ConsoleTqdm)]

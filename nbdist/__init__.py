"""nbdist: a notebook as the control room of a cluster of PyTorch ranks.

Client side (the notebook kernel) imports nothing heavy here; rank-side helpers such as
``nbdist.log`` and ``nbdist.prepare`` are resolved lazily so that ``import nbdist`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nbdist._version import __version__
from nbdist.errors import NbdistWarning

# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "Cluster": "nbdist.api",
    "CellResult": "nbdist.cells.result",
    "DistributedCellError": "nbdist.errors",
    "NbdistError": "nbdist.errors",
    "NbdistConfig": "nbdist.config",
    "log": "nbdist.worker.metrics",
    "memory_budget": "nbdist.worker.rank_memory",
    "profile": "nbdist.worker.profiling",
    "prepare": "nbdist.strategies",
    "save_checkpoint": "nbdist.strategies.checkpoint",
    "load_checkpoint": "nbdist.strategies.checkpoint",
    "consolidate_checkpoint": "nbdist.strategies.checkpoint",
    "memory_breakdown": "nbdist.memory",
    "estimate_memory": "nbdist.memory",
    "compare_strategies": "nbdist.memory",
    "advise": "nbdist.memory.advisor",
    "diff": "nbdist.cells.diff",
    "lint": "nbdist.cells.lint",
}

__all__ = ["__version__", "NbdistWarning", "load_ipython_extension", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.api import Cluster as Cluster
    from nbdist.cells.result import CellResult as CellResult
    from nbdist.config import NbdistConfig as NbdistConfig
    from nbdist.errors import DistributedCellError as DistributedCellError
    from nbdist.errors import NbdistError as NbdistError


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbdist``: register the magics, the features' among them."""
    from nbdist.features import register_feature_magics
    from nbdist.notebook.magics import current_cluster, register_magics

    register_magics(ipython)
    register_feature_magics(ipython, current_cluster)


def unload_ipython_extension(ipython: Any) -> None:
    from nbdist.notebook.magics import unregister_magics

    unregister_magics(ipython)

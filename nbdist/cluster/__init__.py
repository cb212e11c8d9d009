"""The cluster layer: engine processes (ipyparallel launchers), the rank table, rendezvous, the
process group's generations, liveness, the orphan watchdog and the telemetry hub.

Nothing here imports the cells, notebook or dashboard layers above it.
"""

import importlib
import warnings
from typing import Any

from nbdist.cluster.core import ClusterCore, RankProcess, free_port

__all__ = ["ClusterCore", "RankProcess", "free_port"]


def __getattr__(name: str) -> Any:
    # `from nbdist.cluster import Cluster` worked while nbdist/cluster.py was one module
    if name == "Cluster":
        warnings.warn("nbdist.cluster.Cluster moved: use nbdist.Cluster", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module("nbdist.api").Cluster
    raise AttributeError(f"module 'nbdist.cluster' has no attribute {name!r}")

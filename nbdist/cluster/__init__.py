"""The cluster layer: engine processes (ipyparallel launchers), the rank table, rendezvous, the
process group's generations, liveness, the orphan watchdog and the telemetry hub.

Nothing here imports the cells, notebook or dashboard layers above it. The package itself imports
nothing: `python -m nbdist.cluster.watchdog` starts beside every cluster and must stay light
(importing `core`, and so ipyparallel, cost it 0.3 s of CPU while the cluster started).
"""

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.cluster.core import ClusterCore, RankProcess, free_port

__all__ = ["ClusterCore", "RankProcess", "free_port"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("nbdist.cluster.core"), name)
    # `from nbdist.cluster import Cluster` worked while nbdist/cluster.py was one module
    if name == "Cluster":
        warnings.warn("nbdist.cluster.Cluster moved: use nbdist.Cluster", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module("nbdist.api").Cluster
    raise AttributeError(f"module 'nbdist.cluster' has no attribute {name!r}")

"""The cluster layer: engine processes (ipyparallel launchers), the rank table, rendezvous, the
process group's generations, liveness and the telemetry hub.

The package imports nothing itself: `python -m nbdist.cluster.controller` starts every cluster's
controller and imports only what ipyparallel's controller needs.
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
    if name == "Cluster":  # a deprecated alias of nbdist.Cluster
        warnings.warn("nbdist.cluster.Cluster moved: use nbdist.Cluster", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module("nbdist.api").Cluster
    raise AttributeError(f"module 'nbdist.cluster' has no attribute {name!r}")

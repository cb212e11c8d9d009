"""The cluster layer: engine processes (ipyparallel launchers), the rank table, rendezvous, the
process group's generations, liveness, the orphan watchdog and the telemetry hub.

Nothing here imports the cells, notebook or dashboard layers above it.
"""

from nbdist.cluster.core import ClusterCore, RankProcess
from nbdist.worker.net import free_port

__all__ = ["ClusterCore", "RankProcess", "free_port"]

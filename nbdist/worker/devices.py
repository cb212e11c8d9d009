"""Which GPUs this engine sees and where its launcher placed it, for the rank map
(nbdist.cluster.ranks decides from every engine's answer)."""

from __future__ import annotations

from collections.abc import Mapping

LOCAL_ID_VARS = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                 "PMI_LOCAL_RANK")
"""Where launchers say which task on the host this is (Slurm, Open MPI, MPICH/Intel MPI)."""


def gpu_uuids(count: int) -> list[str]:
    """The UUIDs of the GPUs this process sees, in its index order: two engines that see the
    same card report the same UUID, whatever CUDA_VISIBLE_DEVICES numbering each was given
    (cgroup limits renumber every task's GPU to 0). A MIG instance has its own UUID."""
    if count <= 0:
        return []
    import torch

    found = []
    for index in range(count):
        try:
            found.append(str(torch.cuda.get_device_properties(index).uuid))
        except (RuntimeError, AssertionError, AttributeError):
            return []  # unknown: the rank map then assumes the engines share their GPUs
    return found


def launcher_local_id(environ: Mapping[str, str]) -> int | None:
    """This task's number among the launcher's tasks on this host, if a launcher says."""
    for name in LOCAL_ID_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None

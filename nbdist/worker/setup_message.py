"""What the notebook tells a rank at set-up and what the rank answers, defined once for both
sides: frozen dataclasses of plain types, pickled by ipyparallel."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.config import NbdistConfig
from nbdist.worker.cell_channel import ChannelEndpoint, ChannelSetup


@dataclass(frozen=True)
class RankSpec:
    """Who a rank is: its place in the world and on its host, its engine, backend and GPUs."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    host: str
    engine_id: int
    backend: str
    gpus: tuple[int, ...] = field(default_factory=tuple)

    @property
    def device(self) -> str:
        return f"cuda:{self.gpus[0]}" if self.gpus else "cpu"

    def env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """The torchrun-compatible environment of this rank."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }


@dataclass(frozen=True)
class RankSetup:
    """What `nbdist.worker.bootstrap.setup_rank` is told."""

    spec: RankSpec
    master_addr: str
    port: int
    generation: int
    """The process group's generation: each rebuild joins a new one on a fresh store."""
    store_path: str | None
    """This generation's FileStore when every rank is on the notebook's machine; else None: a
    TCP store on rank 0."""
    threads: int
    cwd: str
    """The notebook's working directory: the rank works there too (when it exists there)."""
    interface: str | None
    """The interface gloo, NCCL and TensorPipe use; None: loopback on one host, else theirs."""
    private_dir: str | None
    """The cluster's private directory, for a rank on this machine only (flight recorder dumps)."""
    channel: ChannelSetup
    config: NbdistConfig

    @property
    def process_group_timeout(self) -> float:
        faults = self.config.faults
        nccl = self.spec.backend == "nccl"
        return faults.nccl_process_group_timeout if nccl else faults.process_group_timeout


@dataclass(frozen=True)
class RankReady:
    """What a rank answers once it is set up and in the process group."""

    device: str
    threads: int
    endpoint: ChannelEndpoint
    notes: tuple[str, ...] = ()
    """Settings the rank kept rather than nbdist's (an NCCL variable the user set...)."""

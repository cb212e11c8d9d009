"""What the notebook tells a rank at set-up and what the rank answers, defined once for both
sides: frozen dataclasses of plain types, pickled by ipyparallel (what the engine is, before
this, is `nbdist.protocol.handshake.ProbeReply`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.config import NbdistConfig
from nbdist.protocol.handshake import ChannelEndpoint, ChannelSetup
from nbdist.protocol.wire import VERSION


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
    shares_gpu: bool = False  # another rank on its host computes on its GPU too (--share-gpu)

    @property
    def device(self) -> str:
        return f"cuda:{self.gpus[0]}" if self.gpus else "cpu"

    def env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """The environment torchrun gives its worker."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.rank // self.local_world_size),
            "GROUP_WORLD_SIZE": str(self.world_size // self.local_world_size),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "nbdist",  # what dist.is_torchelastic_launched() reads
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }


@dataclass(frozen=True)
class RankSetup:
    spec: RankSpec
    master_addr: str
    port: int
    generation: int  # each rebuild joins a new one on a fresh store
    store_path: str | None  # a FileStore when every rank is on this machine; else TCP on rank 0
    threads: int
    cwd: str  # the notebook's: the rank works there too (when it exists there)
    interface: str | None  # for gloo, NCCL, TensorPipe; None: loopback on one host, else theirs
    private_dir: str | None  # the cluster's, for a rank on this machine only (flight recorder)
    channel: ChannelSetup
    config: NbdistConfig
    protocol: int = VERSION  # the notebook's: a rank that speaks another refuses to set up

    @property
    def process_group_timeout(self) -> float:
        faults = self.config.faults
        nccl = self.spec.backend == "nccl"
        return faults.nccl_process_group_timeout if nccl else faults.process_group_timeout


@dataclass(frozen=True)
class RankReady:
    device: str
    threads: int
    endpoint: ChannelEndpoint
    notes: tuple[str, ...] = ()  # settings the rank kept rather than nbdist's (a user's NCCL_*)

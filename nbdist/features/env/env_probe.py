"""The rank half of `%dist_env`: the `env.collect` command, answered on the rank service's thread
(it reads, never changes, so it answers while a cell runs or pdb waits)."""

from __future__ import annotations

import os
import platform
import socket
import sys

from nbdist.features.env.env_table import RankEnv
from nbdist.worker.rank_service import command


@command("env.collect")
def collect() -> RankEnv:
    import torch

    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else ""
    except Exception:  # a build without NCCL
        nccl = ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    devices = f"{count} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    return RankEnv(
        rank=int(os.environ.get("RANK", "-1")), host=socket.gethostname(), pid=os.getpid(),
        python=f"{platform.python_version()} ({sys.executable})", torch=str(torch.__version__),
        cuda=torch.version.cuda or "", nccl=nccl, devices=devices if count else "CPU only",
        environ=dict(os.environ))

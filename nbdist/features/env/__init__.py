"""`%dist_env` / `Cluster.env()`: every rank's host, Python, torch, CUDA, NCCL, visible devices
and the environment variables that differ between ranks, with what differs marked."""

from nbdist.features.env.env_magic import cluster_env, register_magic
from nbdist.features.env.env_table import EnvTable, RankEnv

__all__ = ["EnvTable", "RankEnv", "cluster_env", "register_magic"]

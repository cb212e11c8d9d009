"""DeepSpeed ZeRO stages 0-3 with CPU/NVMe offload, run inside an existing process group.

Either shorthand options build the config, or the user's own config (dict or JSON file) goes
through untouched. DeepSpeed is an optional extra and is imported only here, on first use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbdist.strategies._common import (
    DEEPSPEED_MISSING,
    BlockSpec,
    OptimizerArg,
    StrategyOptionError,
    apply_activation_checkpointing,
    broadcast_from_rank0,
    check_known,
    rank_device,
    refuse_spread,
    reject,
)
from nbdist.strategies.base import Sharding, adam_bytes

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn


@dataclass
class DeepSpeedOptions:
    """The options `prepare(..., strategy="deepspeed", ...)` takes (and zero0-zero3, whose
    names set `zero_stage`)."""

    zero_stage: int = 2
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters."""

    offload_optimizer: str | None = None
    """"cpu" or "nvme": optimizer state and step off the device (ZeRO-Offload, stages 1-3)."""

    offload_param: str | None = None
    """"cpu" or "nvme": parameter shards live off the device between uses (stage 3 only)."""

    nvme_path: str | None = None
    """Directory on a fast local NVMe drive; required when an offload target is "nvme"."""

    mixed_precision: str | None = None
    """"bf16" or "fp16": 16-bit params and grads with fp32 master weights in the optimizer."""

    micro_batch_size: int = 1
    """train_micro_batch_size_per_gpu in the generated config (DeepSpeed requires one)."""

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; engine.step() only steps at the boundary."""

    gradient_clipping: float | None = None
    """Clip the global gradient norm to this value in engine.step()."""

    activation_checkpointing: BlockSpec = None
    """Recompute these blocks in backward without model changes ("auto": ModuleList children)."""

    config: dict[str, Any] | str | Path | None = None
    """A complete DeepSpeed config (dict or JSON path), passed to deepspeed.initialize as is."""

    log_level: str = "WARNING"
    """Level for DeepSpeed's own logger (its INFO lines would flood every rank's output)."""


HINTS = {
    "cpu_offload": "DeepSpeed offloads optimizer state and parameters separately: use "
    "offload_optimizer='cpu' (any zero_stage >= 1) and/or offload_param='cpu' (zero_stage=3)",
    "reshard_after_forward": "an FSDP option; with DeepSpeed choose zero_stage=3 (params sharded, "
    "~FULL_SHARD) or zero_stage=2 (~SHARD_GRAD_OP)",
    "sharding": "an FSDP option; with DeepSpeed choose zero_stage=3 or zero_stage=2",
    "wrap": "an FSDP option; ZeRO-3 gathers parameters per module by itself",
    "gradient_as_bucket_view": "a DDP option; DeepSpeed manages its own buckets",
    "find_unused_parameters": "a DDP option; DeepSpeed handles unused parameters itself",
}

_SHORTHANDS = (
    "zero_stage", "offload_optimizer", "offload_param", "nvme_path", "mixed_precision",
    "micro_batch_size", "gradient_accumulation_steps", "gradient_clipping",
)


def wrap(model: nn.Module, optimizer: OptimizerArg, **options: Any) -> tuple[Any, Any]:
    """``deepspeed.initialize`` on the existing group; returns (engine, engine.optimizer)."""
    reject(options, HINTS, "deepspeed")
    check_known(options, [f.name for f in dataclasses.fields(DeepSpeedOptions)], "deepspeed")
    given_shorthands = [k for k in _SHORTHANDS if k in options]
    opts = DeepSpeedOptions(**options)
    if opts.config is not None and given_shorthands:
        raise StrategyOptionError(
            f"pass either config=... (used untouched) or the shorthand options, not both; "
            f"move {', '.join(given_shorthands)} into your config (e.g. zero_stage -> "
            "config['zero_optimization']['stage'])"
        )
    param_count = sum(p.numel() for p in model.parameters())
    largest = max((p.numel() for p in model.parameters()), default=1)
    if opts.config is not None:
        config = _user_config(opts.config)
    else:
        config = build_config(opts, param_count, largest)
    ds = import_deepspeed()
    logging.getLogger("DeepSpeed").setLevel(opts.log_level)
    # DeepSpeed (0.19) calls collectives that torch 2.13 deprecated; one warning per call and
    # rank would bury the cell's own output.
    deprecated = r"`torch\.distributed\.\w+` is deprecated"
    warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)

    import torch

    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(model.parameters())
    if opts.config is None and opts.offload_optimizer is not None:
        optimizer = _cpu_adam_for_offload(optimizer)
    # DeepSpeed's engine moves the whole module to its one device (engine.module.to(device))
    refuse_spread(model, "deepspeed", "moves the whole model to one device per rank")
    if opts.offload_param is None:  # with param offload ZeRO-3 places the shards itself
        model.to(rank_device())
    broadcast_from_rank0(model)  # ZeRO-3 partitions each rank's own copy: make them agree first
    apply_activation_checkpointing(model, opts.activation_checkpointing)
    if opts.config is None and opts.mixed_precision is not None:
        _cast_float_inputs(model, config)
    args = device_args(int(config.get("zero_optimization", {}).get("stage", 0)))
    engine, ds_optimizer, _, _ = ds.initialize(
        model=model, optimizer=optimizer, config=config, args=args
    )
    return engine, ds_optimizer


def device_args(zero_stage: int) -> Any:
    """DeepSpeed's ``args`` naming the rank's own GPU (its engine otherwise takes LOCAL_RANK as
    the device index: wrong with several GPUs per rank or one visible GPU per task); None on CPU.
    """
    import os
    from types import SimpleNamespace

    device = rank_device()
    if device.type != "cuda" or device.index is None:
        return None
    local_rank = os.environ.get("LOCAL_RANK")
    if zero_stage == 3 and local_rank is not None and int(local_rank) != device.index:
        # ZeRO-3's parameter partitioning places the gathered parameters on cuda:LOCAL_RANK
        raise StrategyOptionError(
            f"zero_stage=3 puts parameters on cuda:LOCAL_RANK (cuda:{local_rank}), but this "
            f"rank computes on {device}. Start one GPU per rank (--gpus-per-rank 1) with every "
            "GPU visible to every rank, or use zero_stage=2 or strategy='fsdp'."
        )
    return SimpleNamespace(device_rank=device.index)


def import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as missing:
        raise ImportError(DEEPSPEED_MISSING) from missing
    return deepspeed


def build_config(opts: DeepSpeedOptions, param_count: int = 500_000_000,
                 largest_param: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config for the shorthand options, after checking they fit together.

    ``largest_param`` (elements of the model's largest parameter) sizes the NVMe parameter swap
    buffers; None keeps DeepSpeed's default.
    """
    _check_stage(opts.zero_stage)
    # ZeRO allocates its reduce bucket whole (5e8 elements by default: 2 GB in fp32); a bucket
    # larger than the model only wastes memory.
    bucket = int(min(5e8, max(param_count, 1)))
    zero: dict[str, Any] = {"stage": opts.zero_stage, "reduce_bucket_size": bucket}
    for name in ("offload_optimizer", "offload_param"):
        target = getattr(opts, name)
        if target is None:
            continue
        if target not in ("cpu", "nvme"):
            raise StrategyOptionError(f"{name}={target!r}: use 'cpu', 'nvme' or None")
        if name == "offload_optimizer" and opts.zero_stage == 0:
            raise StrategyOptionError("offload_optimizer needs ZeRO: set zero_stage to 1, 2 or 3")
        if name == "offload_param" and opts.zero_stage != 3:
            raise StrategyOptionError(
                "offload_param needs sharded parameters: set zero_stage=3 (got"
                f" {opts.zero_stage}), or offload only the optimizer with offload_optimizer='cpu'"
            )
        zero[name] = {"device": target, "pin_memory": rank_device().type == "cuda"}
        if target == "nvme":
            zero[name]["nvme_path"] = _nvme_path(opts.nvme_path, name)
            if name == "offload_param" and largest_param is not None:
                # ZeRO-3 allocates buffer_count (5) swap buffers of buffer_size elements, locked in
                # host memory, whatever the model (1e8 by default: ~2 GB in fp32). One buffer holds
                # one parameter's partition, so the largest parameter is enough.
                zero[name]["buffer_size"] = int(min(1e8, max(largest_param, 1)))
    if opts.nvme_path is not None and "nvme" not in (opts.offload_optimizer, opts.offload_param):
        raise StrategyOptionError(
            "nvme_path is only used with offload_optimizer='nvme' or offload_param='nvme'"
        )
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": opts.micro_batch_size,
        "gradient_accumulation_steps": opts.gradient_accumulation_steps,
        "zero_optimization": zero,
        # nbdist passes torch optimizers in; ZeRO only "trusts" DeepSpeed's own unless told.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
    }
    if opts.mixed_precision is not None:
        dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
        key = dtypes.get(opts.mixed_precision)
        if key is None:
            raise StrategyOptionError(
                f"mixed_precision={opts.mixed_precision!r}: use 'bf16', 'fp16' or None"
            )
        config[key] = {"enabled": True}
    if opts.gradient_clipping is not None:
        config["gradient_clipping"] = opts.gradient_clipping
    return config


def _cast_float_inputs(model: nn.Module, config: dict[str, Any]) -> None:
    """Cast floating-point inputs to the 16-bit compute dtype, as FSDP2's policy does.

    DeepSpeed turns the weights to bf16/fp16 but leaves inputs alone, so an fp32 batch would
    fail in the first matmul; this keeps the same training loop working for every strategy.
    """
    import torch

    dtype = torch.bfloat16 if "bf16" in config else torch.float16

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    def cast(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(cast, with_kwargs=True)


def _nvme_path(path: str | None, option: str) -> str:
    if path is None:
        raise StrategyOptionError(
            f"{option}='nvme' needs nvme_path='/path/on/local/nvme' (a directory DeepSpeed may"
            " fill)"
        )
    if not Path(path).is_dir():
        raise StrategyOptionError(
            f"nvme_path={path!r} is not an existing directory on this rank's host"
        )
    builder = import_deepspeed().ops.op_builder.AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise StrategyOptionError(
            f"{option}='nvme' needs DeepSpeed's async_io op, which cannot be built on this host "
            "(libaio headers are missing): `apt-get install libaio-dev` (or conda's libaio) on "
            "every rank's host, or offload to 'cpu' instead"
        )
    return str(path)


def _user_config(config: dict[str, Any] | str | Path) -> dict[str, Any] | str:
    if isinstance(config, dict):
        return config
    if not Path(config).is_file():
        raise StrategyOptionError(
            f"config={str(config)!r}: no such DeepSpeed config file on this rank's host"
        )
    return str(config)


def _cpu_adam_for_offload(optimizer: Any) -> Any:
    """ZeRO-Offload steps on the CPU: torch Adam/AdamW become DeepSpeed's vectorised CPU Adam."""
    import torch

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        # Runs as given on the CPU partitions: slower, but zero_force_ds_cpu_optimizer is off.
        return optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    d = optimizer.defaults
    kept = ("params", "lr", "betas", "eps", "weight_decay")
    groups = [{k: v for k, v in g.items() if k in kept} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(
        groups,
        lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
        adamw_mode=type(optimizer) is torch.optim.AdamW,
    )


@dataclass(frozen=True)
class ZeroStrategy:
    """One ZeRO stage under DeepSpeed; its engine scales, reduces, steps and checkpoints itself."""

    name: str
    sharding: Sharding
    stage: int
    family: str = "deepspeed"
    checkpoint_format: str = "deepspeed"
    engine_accumulates: bool = True

    def wrap(self, model: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        return wrap(model, optimizer, **options)

    def backward(self, model: Any, loss: Any) -> None:
        model.backward(loss)  # scales for accumulation and reduces into ZeRO's partitions

    def step(self, model: Any, optimizer: Any) -> None:
        model.step()  # steps, zeroes grads and advances DeepSpeed's own counters

    def bytes_per_param(self, precision: str) -> tuple[float, float, float]:
        # Stage 0 hands the torch optimizer through; ZeRO's optimizers keep an fp32 master shard.
        return adam_bytes(precision, fp32_master=self.stage >= 1)

    def save_state(self, path: Path, model: Any, optimizer: Any) -> None:
        model.save_checkpoint(str(path))

    def load_state(self, path: Path, model: Any, optimizer: Any, saved_format: str) -> None:
        if saved_format != "deepspeed":
            raise ValueError(
                f"{path} holds a {saved_format} checkpoint; load it into a DDP/FSDP model, or "
                "consolidate it and load the full state dict into the DeepSpeed engine's module"
            )
        loaded, _ = model.load_checkpoint(str(path), load_optimizer_states=optimizer is not None)
        if loaded is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path}")

    def release(self, model: Any) -> None:
        destroy = getattr(model, "destroy", None)  # DeepSpeedEngine: drop hooks and buffers
        if callable(destroy):
            destroy()


ZERO_STAGES = {
    stage: ZeroStrategy(
        f"zero{stage}", Sharding(params=stage >= 3, grads=stage >= 2, optimizer=stage >= 1), stage
    )
    for stage in (0, 1, 2, 3)
}


def strategy_for(name: str, options: dict[str, Any]) -> tuple[ZeroStrategy, dict[str, Any]]:
    """``strategy="deepspeed"`` (the stage comes from zero_stage or the config) or ``"zeroN"``
    (zero_stage=N is filled in), and the options that realise it."""
    if name == "deepspeed":
        stage = options.get("zero_stage")
        if stage is None and options.get("config") is not None:
            stage = _config_stage(options["config"])
        elif stage is None:
            stage = DeepSpeedOptions.zero_stage
        return ZERO_STAGES[_check_stage(stage)], options
    stage = int(name.removeprefix("zero"))
    if options.get("config") is not None:
        raise StrategyOptionError(
            f"strategy={name!r} sets the ZeRO stage; with config=... use "
            "strategy='deepspeed' and put the stage in the config"
        )
    if options.get("zero_stage", stage) != stage:
        raise StrategyOptionError(
            f"strategy={name!r} is ZeRO stage {stage} but"
            f" zero_stage={options['zero_stage']!r}: pass one of them"
        )
    return ZERO_STAGES[stage], {**options, "zero_stage": stage}


def _check_stage(stage: Any) -> int:
    if stage not in ZERO_STAGES:
        raise StrategyOptionError(f"zero_stage={stage!r}: use 0, 1, 2 or 3")
    return int(stage)


def _config_stage(config: dict[str, Any] | str | Path) -> int:
    """The ZeRO stage a user's config asks for (DeepSpeed's default is 0); 0 when unreadable,
    since wrap() reports a missing file itself."""
    if not isinstance(config, dict):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return 0
    stage = config.get("zero_optimization", {}).get("stage", 0)
    return stage if stage in ZERO_STAGES else 0

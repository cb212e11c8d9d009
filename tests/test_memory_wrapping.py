"""memory_breakdown says which wrapping the model actually got on each rank (DDP, FSDP2, a DeepSpeed
engine, none), and warns when a Hugging Face Trainer asked for FSDP but got DDP, as it does on CPU
(accelerate keeps the FSDP plugin for accelerators only). Real ranks, a real tiny Trainer.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nbdist import Cluster

NEEDS_TRANSFORMERS = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "accelerate")),
    reason='transformers and accelerate not installed: pip install -e ".[frameworks]"',
)

WRAPPINGS_CODE = """
got = {}
for name, model in [("plain", Net()), ("ddp", build("ddp").model), ("fsdp", build("fsdp").model)]:
    report = nbdist.memory_breakdown(model)
    wrappings = [r.wrapping for r in report.ranks]
    got[name] = (wrappings, report.headline(), report.rows()[0]["wrapping"])
"""


@pytest.mark.fsdp2
def test_breakdown_names_the_wrapping_each_model_got(ranks2: Cluster) -> None:
    ranks2.run(WRAPPINGS_CODE).raise_for_errors()
    got = ranks2.pull("got")[0]
    assert got["plain"] == (["none", "none"], "model wrapped by: no wrapper", "none")
    assert got["ddp"] == (["ddp", "ddp"], "model wrapped by: DDP", "ddp")
    assert got["fsdp"] == (["fsdp", "fsdp"], "model wrapped by: FSDP2", "fsdp")


@pytest.mark.deepspeed
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="pip install nbdist[deepspeed]")
def test_breakdown_names_a_deepspeed_engine_and_its_stage(ranks2: Cluster) -> None:
    ranks2.run(
        "p = build('deepspeed', zero_stage=2)\nreport = nbdist.memory_breakdown(p.model)\n"
        "ds = ([r.wrapping for r in report.ranks], report.headline())\np.model.destroy()"
    ).raise_for_errors()
    assert ranks2.pull("ds")[0] == (["zero2", "zero2"], "model wrapped by: DeepSpeed ZeRO-2")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (FSDP1 refuses CPU ranks)")
def test_breakdown_names_fsdp1_on_a_gpu(cluster_factory, small_model_code: str) -> None:
    cluster = cluster_factory(1)
    cluster.run(
        small_model_code + "\nfrom torch.distributed.fsdp import FullyShardedDataParallel\n"
        "model = FullyShardedDataParallel(Net().to(device), device_id=torch.device(device))\n"
        "report = nbdist.memory_breakdown(model)\n"
        "got = ([r.wrapping for r in report.ranks], report.headline())"
    ).raise_for_errors()
    assert cluster.pull("got")[0] == (["fsdp1"], "model wrapped by: FSDP")


TRAINER_CODE = """
import os, warnings
os.environ["HF_HUB_OFFLINE"] = "1"
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    tokens = torch.randint(64, (16, 8), generator=torch.Generator().manual_seed(3))
    def __len__(self):
        return len(self.tokens)
    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}

def tiny_trainer(out, **sharding):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2,
                             report_to="none", save_strategy="no", disable_tqdm=True,
                             use_cpu=True, ddp_backend="gloo", **sharding)
    return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())

def measure(trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = nbdist.memory_breakdown(trainer)
    said = [str(w.message) for w in caught if isinstance(w.message, nbdist.NbdistWarning)]
    return [r.wrapping for r in report.ranks], report.headline(), said, report.ranks[0].params
"""


@pytest.mark.frameworks
@NEEDS_TRANSFORMERS
def test_trainer_asked_for_fsdp_on_cpu_is_reported_as_ddp(ranks2: Cluster, tmp_path) -> None:
    ranks2.run(TRAINER_CODE).raise_for_errors()
    ranks2.run(
        f"sharded = tiny_trainer({str(tmp_path / 'fsdp')!r}, fsdp='full_shard')\n"
        "before = measure(sharded)\nsharded.train()\nafter = measure(sharded)\n"
        "full = sum(p.numel() * p.element_size() for p in sharded.model.parameters())\n"
        f"plain = tiny_trainer({str(tmp_path / 'ddp')!r})\nplain.train()\n"
        "plain_measured = measure(plain)"
    ).raise_for_errors()
    for rank in (0, 1):
        wrappings, headline, said, params = ranks2.pull("after")[rank]
        # accelerate wrapped it with DDP: every rank holds every parameter
        assert wrappings == ["ddp", "ddp"] and params >= ranks2.pull("full")[rank]
        expected = ("TrainingArguments asked for FSDP but the model got DDP (accelerate does "
                    "not use FSDP on CPU): every rank holds the whole model, nothing is sharded")
        assert said == [expected]
        assert headline == f"model wrapped by: DDP\nwarning: {expected}"
        # before train() the Trainer has not wrapped anything yet, and says so
        wrappings, headline, said, _ = ranks2.pull("before")[rank]
        assert wrappings == ["none", "none"] and len(said) == 1 and "not wrapped yet" in said[0]
        # a Trainer that asked for nothing special gets DDP and no warning
        wrappings, headline, said, _ = ranks2.pull("plain_measured")[rank]
        assert (wrappings, headline, said) == (["ddp", "ddp"], "model wrapped by: DDP", [])

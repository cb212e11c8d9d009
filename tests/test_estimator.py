"""Pure checks of the memory estimator, the advisor and the chart: no cluster, no torch needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

import nbdist
from nbdist.dashboard.colors import rank_color
from nbdist.memory import TransformerShape
from nbdist.memory.chart import render_svg, render_table


@pytest.mark.parametrize(("strategy", "gb"), [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_figure_1(strategy: str, gb: float):
    # ZeRO paper Fig. 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)
    estimate = nbdist.estimate_memory(7.5e9, 64, strategy)
    assert round(estimate.model_states / 1e9, 1) == gb


def test_gpt2_xl_model_states_and_fp32_split():
    # ZeRO paper §3.1: GPT-2 1.5B needs at least 24 GB of model states against 3 GB of fp16 weights
    gpt2_xl = TransformerShape(layers=48, hidden=1600, heads=25, seq_len=1024, vocab_size=50257)
    mixed = nbdist.estimate_memory(gpt2_xl, 1, "ddp")
    assert 1.5e9 < gpt2_xl.param_count < 1.6e9
    assert mixed.model_states >= 24e9 and 3e9 < mixed.params < 3.2e9
    fp32 = nbdist.estimate_memory(1000, 1, "ddp", precision="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 4000, 8000)  # same 16Ψ, split 4 + 4 + 8
    # DeepSpeed keeps an fp32 master partition even for an fp32 model (measured, see bytes_per_param)
    assert nbdist.estimate_memory(1000, 2, "zero3", precision="fp32").optimizer == 6000


def test_fsdp_full_shard_matches_zero3_and_formula_text():
    fsdp = nbdist.estimate_memory(1e9, 8, "fsdp")
    assert fsdp.model_states == nbdist.estimate_memory(1e9, 8, "zero3").model_states == 2e9
    assert nbdist.estimate_memory(1e9, 8, "zero2").formula == "2Ψ + 2Ψ/N + 12Ψ/N"


def test_activation_formula_and_checkpointing():
    shape = TransformerShape(layers=2, hidden=1024, heads=16, seq_len=512)
    s, b, h, a = 512, 4, 1024, 16
    per_layer = s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al., 16-bit
    full = nbdist.estimate_memory(shape, 1, "ddp", micro_batch=b)
    assert full.activations == pytest.approx(2 * per_layer)
    ckpt = nbdist.estimate_memory(shape, 1, "ddp", micro_batch=b, activation_checkpointing=True)
    assert ckpt.activations == pytest.approx(2 * 2 * s * b * h + per_layer)
    assert full.total == pytest.approx(full.model_states + full.activations)


def test_offload_moves_bytes_to_host():
    base = nbdist.estimate_memory(1e9, 4, "zero3")
    off = nbdist.estimate_memory(1e9, 4, "zero3", offload_optimizer=True, offload_param=True)
    assert off.model_states == 0 and off.offloaded == pytest.approx(base.model_states)
    fsdp = nbdist.estimate_memory(1e9, 4, "fsdp", offload_param=True)
    assert fsdp.offloaded == pytest.approx(base.model_states)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "zero4"}, "use one of"),
        ({"strategy": "ddp", "offload_optimizer": True}, "DDP cannot offload"),
        ({"strategy": "zero2", "offload_param": True}, "needs sharded parameters"),
        ({"strategy": "ddp", "precision": "int8"}, "precision"),
    ],
)
def test_estimator_rejects_impossible_setups(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        nbdist.estimate_memory(1e9, 8, **kwargs)


@pytest.mark.parametrize(
    ("params", "gpus", "memory", "expected"),
    [
        (125e6, 8, 80e9, "ddp"),  # small: DDP wins
        (1.5e9, 8, 24e9, "zero2"),  # DDP's 24 GB does not fit a 24 GB card
        (7.5e9, 16, 24e9, "zero3"),
        (20e9, 8, 40e9, "zero3+offload_optimizer"),
        (3e9, 1, 24e9, "zero2+offload_optimizer"),  # one GPU: nothing to shard across
        (1e12, 8, 80e9, "none"),
    ],
)
def test_advisor(params: float, gpus: int, memory: float, expected: str):
    advice = nbdist.advise(params, gpus, memory, cpu_memory=256e9)
    assert advice.strategy == expected
    assert advice.reasons and str(advice).startswith(expected)
    if expected not in ("none",):
        assert advice.per_gpu_bytes <= memory


def test_advisor_prefers_sharding_above_500m_even_when_ddp_fits():
    advice = nbdist.advise(600e6, 8, 80e9)
    assert advice.strategy == "zero2" and advice.fsdp_kwargs == {"strategy": "fsdp", "reshard_after_forward": False}


def test_advisor_says_a_small_model_needs_megabytes_not_zero_gigabytes():
    """A tutorial's 1M-parameter model: 16 bytes each under DDP in fp32."""
    intro = nbdist.advise(1_000_000, 2, 16e9, precision="fp32").reasons[0]
    assert intro.startswith("1M parameters need 16.0 MB of model states per GPU")
    assert "0.0 GB" not in intro and nbdist.advise(530_000, 2, 16e9).reasons[0].startswith("0.53M")
    assert "the budget is 12.8 GB per GPU" in intro


def test_chart_is_pure_and_uses_rank_colors():
    rows = [{"rank": r, "params": 4e6, "grads": 4e6, "optimizer": 8e6, "activations": 1e6, "other": None}
            for r in range(3)]
    svg = render_svg(rows)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert all(rank_color(r) in svg and f"rank {r}" in svg for r in range(3))
    table = render_table(rows, ("params", "total"))
    assert table.splitlines()[2].split()[:3] == ["0", "3.81", "MiB"]


def test_import_nbdist_and_estimate_stay_light():
    # The notebook side must not pay for torch or deepspeed to import nbdist or to estimate.
    code = ("import sys, nbdist; nbdist.estimate_memory(1e9, 8, 'zero3'); nbdist.advise(1e9, 8, 80e9); "
            "import nbdist.strategies; nbdist.prepare; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

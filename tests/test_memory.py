"""memory_breakdown and compare_strategies on real CPU ranks (CUDA ranks too where two GPUs exist):
exact model-state bytes, activations from one forward, every rank gathered, and measured beside the
ZeRO formulas.
"""

from __future__ import annotations

import pytest

from nbdist import Cluster


def test_breakdown_is_exact_gathered_and_leaves_training_alone(ranks2_on_device: Cluster, small_model_psi: int):
    ranks2, psi = ranks2_on_device, small_model_psi
    ranks2.run(
        "p = build('ddp')\ntrain(p, 2)\n"
        "report = nbdist.memory_breakdown(p.model, p.optimizer, x, loss_fn)\n"
        "rows = report.rows()\nhtml = report._repr_html_()\n"
        "import gc\ndef live():\n    gc.collect()\n    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())\n"
        "before = live()\nfor _ in range(3): nbdist.memory_breakdown(p.model, p.optimizer, x, loss_fn, gather=False)\n"
        "leaked = live() - before\n"
        "after = train(p, 2)\n"
        "q = build('ddp')\ntrain(q, 2)\nplain = train(q, 2)"
    ).raise_for_errors()
    rows = ranks2.pull("rows")
    assert [r["rank"] for r in rows[0]] == [0, 1] and rows[0] == rows[1]  # every rank gets the table
    for row in rows[0]:
        assert row["params"] == 4 * psi  # fp32 weights, counted once
        assert row["grads"] == 0  # zero_grad(set_to_none=True) ran; DDP's buckets are "other"
        assert 8 * psi <= row["optimizer"] <= 8 * psi + 64  # Adam's two moments (+ step scalars)
        assert 0 < row["activations"] < 2 * psi
        assert row["other"] is not None and row["allocated"] >= row["model_states"]
    # the measuring forward's saved tensors die with it (an autograd cycle once kept them all, so
    # a leak shows as more live tensors after); fewer after is fine: a rank's threads free theirs
    assert all(n <= 0 for n in ranks2.pull("leaked").values())
    html = ranks2.pull("html")[0]
    assert "<svg" in html and "rank 1" in html
    # the measuring forward dropped its graph: training continues exactly as without it
    assert ranks2.pull("after") == ranks2.pull("plain")


@pytest.mark.fsdp2
def test_recompute_and_gathered_parameters_show_up(ranks2: Cluster, small_model_psi: int):
    psi = small_model_psi
    ranks2.run(
        "def measure(**options):\n"
        "    p = build('fsdp', **options)\n    train(p, 1)\n"
        "    return nbdist.memory_breakdown(p.model, p.optimizer, x, loss_fn, gather=False).rows()[0]\n"
        "full = measure()\nrecompute = measure(activation_checkpointing='auto')\n"
        "grad_op = measure(reshard_after_forward=False)"
    ).raise_for_errors()
    full, recompute, grad_op = (ranks2.pull(n)[0] for n in ("full", "recompute", "grad_op"))
    assert full["params"] == 4 * psi // 2 and full["gathered"] == 0
    # per block, 2 saved tensors (fc1 input, relu output) become 1 (the block input); the loss keeps 1
    assert recompute["activations"] == full["activations"] * 5 // 9
    # SHARD_GRAD_OP keeps the gathered blocks from forward to backward (the root unit stays sharded)
    assert grad_op["gathered"] >= 3 * 4 * psi // 4 // 2

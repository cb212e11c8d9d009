"""The docs' drawn pictures are what their scripts draw: a changed script, or a hand-edited picture,
fails until the picture is drawn again (`python docs/tools/draw_zero_states.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_zero_states_picture_is_drawn_by_its_script() -> None:
    spec = importlib.util.spec_from_file_location("draw", ROOT / "docs/tools/draw_zero_states.py")
    assert spec is not None and spec.loader is not None
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    picture = draw.draw()
    assert draw.OUT.read_text(encoding="utf-8") == picture
    # the per-rank figures of the ZeRO paper (mixed-precision Adam) at N = 4
    for row in ("16Ψ<", "4Ψ + 12Ψ/N = 7Ψ", "2Ψ + 14Ψ/N = 5.5Ψ", "16Ψ/N = 4Ψ"):
        assert row in picture

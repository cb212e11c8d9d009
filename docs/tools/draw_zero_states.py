"""Draw docs/images/zero_states.svg: which model states each of 4 ranks holds under DDP and each
ZeRO stage, and what that costs per rank (mixed-precision Adam, the ZeRO paper's accounting).

    python docs/tools/draw_zero_states.py      # rewrites the picture; tests/test_docs_pictures.py
                                               # fails when the committed one differs
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "images" / "zero_states.svg"
RANKS = 4
STATES = (  # name, bytes per parameter, colour
    ("fp16 parameters", 2, "#4e79a7"),
    ("fp16 gradients", 2, "#f28e2b"),
    ("fp32 Adam states (master weights, m, v)", 12, "#59a14f"),
)
ROWS = (  # label, which states are sharded (by index into STATES)
    ("DDP", set()),
    ("ZeRO-1", {2}),
    ("ZeRO-2", {1, 2}),
    ("ZeRO-3 / FSDP", {0, 1, 2}),
)
LEFT, RANK_W, GAP, BAR_H, ROW_H, TOP = 120, 118, 12, 10, 56, 52


def _per_rank(sharded: set[int]) -> str:
    """Bytes per parameter one rank holds, as the paper writes it: 2Ψ + 14Ψ/N with N = 4."""
    whole = sum(b for i, (_, b, _) in enumerate(STATES) if i not in sharded)
    split = sum(b for i, (_, b, _) in enumerate(STATES) if i in sharded)
    parts = ([f"{whole}Ψ"] if whole else []) + ([f"{split}Ψ/N"] if split else [])
    total = Fraction(whole) + Fraction(split, RANKS)
    return " + ".join(parts) + (f" = {float(total):g}Ψ" if split else "")


def _text(x: float, y: float, text: str, anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x:g}" y="{y:g}" text-anchor="{anchor}" font-weight="{weight}" '
            f'font-size="12" fill="#222">{text}</text>')


def _rank_box(x: float, y: float, rank: int, sharded: set[int]) -> list[str]:
    out = [f'<rect x="{x:g}" y="{y:g}" width="{RANK_W}" height="{ROW_H - 12}" rx="5" '
           'fill="#fafafa" stroke="#bbb"/>']
    inner = RANK_W - 16
    for i, (_, _, colour) in enumerate(STATES):
        bar_y = y + 7 + i * (BAR_H + 2)
        out.append(f'<rect x="{x + 8:g}" y="{bar_y:g}" width="{inner}" height="{BAR_H}" '
                   f'fill="none" stroke="{colour}" stroke-opacity="0.45" stroke-dasharray="3 2"/>')
        width, left = (inner, x + 8)
        if i in sharded:  # this rank's 1/N slice of that state
            width, left = inner / RANKS, x + 8 + rank * inner / RANKS
        out.append(f'<rect x="{left:g}" y="{bar_y:g}" width="{width:g}" height="{BAR_H}" '
                   f'fill="{colour}"/>')
    return out


def draw() -> str:
    width = LEFT + RANKS * (RANK_W + GAP) + 150
    height = TOP + len(ROWS) * ROW_H + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" role="img" '
           'aria-label="model states per rank under DDP and ZeRO stages 1 to 3">',
           f'<rect width="{width}" height="{height}" fill="#fff"/>',
           _text(12, 20, "What each of N = 4 ranks holds (filled: its own; dashed: the whole model)",
                 weight="bold")]
    for r in range(RANKS):
        out.append(_text(LEFT + r * (RANK_W + GAP) + RANK_W / 2, TOP - 10, f"rank {r}", "middle"))
    out.append(_text(width - 12, TOP - 10, "bytes per rank", "end"))
    for row, (label, sharded) in enumerate(ROWS):
        y = TOP + row * ROW_H
        out.append(_text(12, y + ROW_H / 2 - 2, label, weight="bold"))
        for r in range(RANKS):
            out += _rank_box(LEFT + r * (RANK_W + GAP), y, r, sharded)
        out.append(_text(width - 12, y + ROW_H / 2 - 2, _per_rank(sharded), "end"))
    legend_y = TOP + len(ROWS) * ROW_H + 14
    x = 12.0
    for name, per_param, colour in STATES:
        out.append(f'<rect x="{x:g}" y="{legend_y - 9:g}" width="12" height="10" fill="{colour}"/>')
        label = f"{name}: {per_param}Ψ"
        out.append(_text(x + 16, legend_y, label))
        x += 36 + 6.6 * len(label)
    out.append(_text(12, legend_y + 18, "Ψ: the model's parameter count, so 2Ψ is 2 bytes per "
                     "parameter (mixed-precision Adam, as in the ZeRO paper)"))
    return "\n".join(out + ["</svg>"]) + "\n"


if __name__ == "__main__":
    OUT.write_text(draw(), encoding="utf-8")
    print(f"wrote {OUT}")

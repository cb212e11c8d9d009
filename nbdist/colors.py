"""One colour per rank, the same in the dashboard, the memory charts and every static SVG.

Hues follow Tableau 10 (readable by most colour-vision deficiencies in its first six); the dark
variants are lightened so lines keep their contrast on JupyterLab's dark theme.
"""

from __future__ import annotations

PALETTE_LIGHT: tuple[str, ...] = (
    "#4e79a7",  # blue
    "#f28e2b",  # orange
    "#e15759",  # red
    "#59a14f",  # green
    "#b07aa1",  # purple
    "#76b7b2",  # teal
    "#9c755f",  # brown
    "#ff9da7",  # pink
    "#79706e",  # grey
    "#d4a62a",  # ochre (Tableau's yellow, darkened to read on white)
)

PALETTE_DARK: tuple[str, ...] = (
    "#7aa6d6",
    "#ffa54f",
    "#ff7b7d",
    "#7fcf73",
    "#d49cc6",
    "#8fd6d0",
    "#c49a82",
    "#ffb8c0",
    "#b3aba8",
    "#f1ce5a",
)

PALETTES: dict[str, tuple[str, ...]] = {"light": PALETTE_LIGHT, "dark": PALETTE_DARK}


def rank_color(rank: int, theme: str = "light") -> str:
    """The colour of ``rank`` (cycles after ten ranks; the line style tells those apart)."""
    palette = PALETTES.get(theme, PALETTE_LIGHT)
    return palette[rank % len(palette)]


def rank_colors(ranks: int, theme: str = "light") -> list[str]:
    """Colours for ranks ``0 … ranks-1``."""
    return [rank_color(rank, theme) for rank in range(ranks)]


def rank_dash(rank: int) -> str:
    """SVG/canvas dash pattern that separates ranks sharing a colour (rank 10 vs rank 0)."""
    cycle = rank // len(PALETTE_LIGHT)
    return ("", "6 3", "2 2", "8 3 2 3")[cycle % 4]

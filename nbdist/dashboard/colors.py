"""The rank palette as the dashboard has always imported it; it lives in ``nbdist.colors`` so the
memory charts, which must not import the dashboard, share the same colours."""

from nbdist.colors import PALETTE_DARK, PALETTE_LIGHT, PALETTES, rank_color, rank_colors, rank_dash

__all__ = ["PALETTES", "PALETTE_DARK", "PALETTE_LIGHT", "rank_color", "rank_colors", "rank_dash"]

"""Client-side dashboards: live per-rank memory, metrics and state, with a static SVG fallback.

``Dashboard`` (the widget) is imported lazily so the pure ``model``/``svg``/``colors`` modules load
without anywidget or ipywidgets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Dashboard", "DashboardConfig"]

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.dashboard.model import DashboardConfig
    from nbdist.dashboard.widget import Dashboard


def __getattr__(name: str) -> Any:
    if name == "Dashboard":
        from nbdist.dashboard.widget import Dashboard

        return Dashboard
    if name == "DashboardConfig":
        from nbdist.dashboard.model import DashboardConfig

        return DashboardConfig
    raise AttributeError(f"module 'nbdist.dashboard' has no attribute {name!r}")

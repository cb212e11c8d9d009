"""One line of a dashboard chart: a growable (x, y) history split into segments, and the min/max
downsampling that keeps spikes visible at any number of points.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class Series:
    """A growable (x, y) line split into segments where x goes backwards (a new cell restarting)."""

    __slots__ = ("x", "y", "n", "starts", "version", "_cache", "history_limit")

    def __init__(self, history_limit: int = 1_000_000) -> None:
        self.x = np.empty(256)
        self.y = np.empty(256)
        self.n = 0
        self.starts: list[int] = [0]
        self.version = 0
        self.history_limit = history_limit
        self._cache: tuple[int, int, np.ndarray, np.ndarray] | None = None

    def extend(self, xs: Any, ys: Any) -> None:
        x = np.asarray(xs, dtype=np.float64)
        y = np.asarray(ys, dtype=np.float64)
        if x.size == 0:
            return
        if self.n + x.size > self.x.size:
            capacity = max(self.x.size * 2, self.n + x.size)
            self.x = np.resize(self.x, capacity)
            self.y = np.resize(self.y, capacity)
        # a new segment wherever x decreases, including against what we already hold
        previous = self.x[self.n - 1] if self.n else -math.inf
        breaks = np.flatnonzero(np.diff(np.concatenate(([previous], x))) < 0)
        self.starts.extend(int(self.n + b) for b in breaks if self.n + b > 0)
        self.x[self.n : self.n + x.size] = x
        self.y[self.n : self.n + x.size] = y
        self.n += x.size
        self.version += 1
        if self.n > self.history_limit:
            self._thin_history()

    def _thin_history(self) -> None:
        # keep the newest half at full resolution; the older half loses every other point
        half = self.n // 2
        old = np.arange(0, half, 2)
        keep = np.concatenate((old, np.arange(half, self.n)))
        starts = set(self.starts)
        self.x[: keep.size] = self.x[keep]
        self.y[: keep.size] = self.y[keep]
        position = {int(old_index): new for new, old_index in enumerate(keep)}
        self.starts = sorted({position.get(s, position.get(s + 1, 0)) for s in starts} | {0})
        self.n = keep.size

    @property
    def last_x(self) -> float | None:
        return float(self.x[self.n - 1]) if self.n else None

    @property
    def last_y(self) -> float | None:
        return float(self.y[self.n - 1]) if self.n else None

    def downsampled(self, points: int) -> tuple[np.ndarray, np.ndarray]:
        """At most ``points`` points (+1 NaN gap per segment break), spikes preserved."""
        cache = self._cache
        if cache is not None and cache[0] == self.version and cache[1] == points:
            return cache[2], cache[3]
        xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        bounds = [*self.starts, self.n]
        for start, end in zip(bounds[:-1], bounds[1:], strict=False):
            if end <= start:
                continue
            share = max(4, int(points * (end - start) / max(self.n, 1)))
            index = start + minmax_indices(self.y[start:end], share)
            if xs:
                xs.append(np.array([np.nan]))
                ys.append(np.array([np.nan]))
            xs.append(self.x[index])
            ys.append(self.y[index])
        x = np.concatenate(xs) if xs else np.empty(0)
        y = np.concatenate(ys) if ys else np.empty(0)
        self._cache = (self.version, points, x, y)
        return x, y


def minmax_indices(y: np.ndarray, points: int) -> np.ndarray:
    """Indices of the min and max of each of ``points // 2`` equal buckets, in order.

    The first and last points are always kept. Unlike striding, a one-step loss spike survives
    any zoom level; NaNs are ignored (a bucket of NaNs keeps its first index).
    """
    n = int(y.size)
    if n <= points:
        return np.arange(n)
    if points < 4:
        return np.unique(np.linspace(0, n - 1, max(points, 2)).astype(np.int64))
    buckets = max(1, (points - 2) // 2)
    edges = np.linspace(1, n - 1, buckets + 1).astype(np.int64)
    size = int(np.max(np.diff(edges)))
    # pad every bucket to the same width so one vectorised argmin/argmax does them all
    offsets = edges[:-1, None] + np.arange(size)[None, :]
    valid = offsets < edges[1:, None]
    offsets = np.minimum(offsets, n - 2)
    values = y[offsets]
    finite = valid & np.isfinite(values)
    low = np.where(finite, values, np.inf).argmin(axis=1)
    high = np.where(finite, values, -np.inf).argmax(axis=1)
    rows = np.arange(buckets)
    picks = np.concatenate(([0], offsets[rows, low], offsets[rows, high], [n - 1]))
    return np.unique(picks)

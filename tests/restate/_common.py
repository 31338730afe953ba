"""Bookkeeping every float64 restatement shares: the per-step log and the ceiling."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

NAN = math.nan
INF = math.inf
RTOL = 3e-5  # float32 clipjax vs a float64 restatement
# z = (g - mean) / std is a difference quotient: near z = 0 its float32 error is
# absolute, about ulp(g) / std = 6e-8 / 0.01..0.1 (measured up to 9e-6 on the
# noise-0.1 streams), not relative. Only ``z`` gets this absolute slack.
Z_ATOL = 5e-5


class _Log:
    """Per-step records plus the counters (count, step, clipped_count, nonfinite_count)."""

    def __init__(self, fields: Sequence[str]) -> None:
        self.rows: dict[str, list] = {k: [] for k in fields}
        self.count = self.step = self.clipped_count = self.nonfinite_count = 0

    def add(self, g: float, threshold: float, scale: float, observed: bool, **stats) -> None:
        finite = math.isfinite(g)
        self.step += 1
        self.count += int(observed)
        self.nonfinite_count += int(not finite)
        clipped = scale < 1.0
        self.clipped_count += int(clipped)
        row = dict(
            grad_norm=g,
            threshold=threshold,
            scale=scale,
            clipped=clipped,
            count=self.count,
            step=self.step,
            clipped_count=self.clipped_count,
            nonfinite_count=self.nonfinite_count,
            **stats,
        )
        for k, v in self.rows.items():
            v.append(row.get(k, NAN))

    def nonfinite(self, g: float, **stats) -> None:
        """A non-finite norm: nothing observed, scale 1, not clipped or capped, and
        ``clip_to`` the norm itself; the threshold and ``z`` on such a step are not
        defined by the rules (NaN here: not compared)."""
        self.add(
            g=g, threshold=NAN, scale=1.0, observed=False, z=NAN, clip_to=g, capped=False, **stats
        )

    def out(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.rows.items()}


COMMON = ["grad_norm", "threshold", "scale", "clipped", "count", "step", "clipped_count",
          "nonfinite_count"]  # fmt: skip


_CEILING_DIV = 1e-6  # the guard of a ceiling's multiplier, max_grad_norm / (g + 1e-6)


def _ceiling(max_grad_norm: Any, feedback: str) -> float:
    """``max_grad_norm="auto"``: 1.0 under feedback "clipped", no ceiling otherwise."""
    if max_grad_norm == "auto":
        return 1.0 if feedback == "clipped" else INF
    return INF if max_grad_norm is None else float(max_grad_norm)


def _capped(g: float, scale: float, cap: float) -> tuple[float, bool]:
    """A rule's ``scale`` bounded by the ceiling ``cap``: ``(scale, capped)``."""
    if not (math.isfinite(g) and g > cap):
        return scale, False
    bound = cap / (g + _CEILING_DIV)
    return min(scale, bound), bound <= scale


def _positive(g: float, eps: float) -> float:
    """What smartclip-style statistics observe: ``g if g > 0 else eps``."""
    return g if g > 0 else eps


def _observation(feedback: str, g: float, boundary: float, target: float, fired: bool) -> float:
    """What a judge-first clip-then-observe step teaches the statistics:
    ``min(g, B)`` under "clipped", the clip target on a (high-side) fire
    under "clip_target", the norm otherwise ("raw"; "skip" observes nothing)."""
    if feedback == "clipped":
        return min(g, boundary)
    if feedback == "clip_target" and fired:
        return target
    return g

"""Levanter's ``clip_update_by_historical_norm`` restated in float64 NumPy, from its code.

stanford-crfm/levanter at commit 9263f81e8b453241332c2c0b2d2001bfb2d2241c,
``src/levanter/optim/clip_update_norm.py`` (``update_fn``), walked over a sequence
of global norms.

``fix=False`` is the published code: every norm, NaN included, enters the window.
``fix=True`` applies clipjax's documented change (a non-finite norm passes unchanged
and never enters the window) and clipjax's ``feedback`` (``"raw"`` is Levanter's).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.restate._common import COMMON, NAN, _Log


def historical_clip(
    norms: Any,
    *,
    rolling_interval_length: int = 128,
    sigma_factor: float = 3.0,
    min_history: int | None = None,
    feedback: str = "raw",
    fix: bool = True,
) -> dict[str, np.ndarray]:
    """Per step: the ``COMMON`` fields (``threshold`` +inf below ``min_history``,
    ``count`` the norms ever entered) and the window's ``mean`` and ``std`` after it."""
    if min_history is None:
        min_history = max(2, rolling_interval_length // 2)
    log = _Log([*COMMON, "mean", "std"])
    window: list[float] = []
    with np.errstate(invalid="ignore"):
        for g in np.asarray(norms, np.float64):
            g = float(g)
            held = np.asarray(window[-rolling_interval_length:], np.float64)
            if fix and not math.isfinite(g):
                log.nonfinite(g, mean=_mean(held), std=_std(held))
                continue
            threshold = math.inf
            if len(held) >= min_history:
                threshold = float(np.mean(held) + sigma_factor * max(float(np.std(held)), 1e-6))
            trigger = g > threshold
            scale = threshold / max(g, 1e-6) if trigger else 1.0
            x, enters = g, True
            if feedback == "clipped" and trigger:
                x = threshold
            elif feedback == "skip" and trigger:
                enters = False
            if enters:
                window.append(x)
            held = np.asarray(window[-rolling_interval_length:], np.float64)
            log.add(g=g, threshold=threshold, scale=scale, observed=enters,
                    mean=_mean(held), std=_std(held))  # fmt: skip
    return log.out()


def _mean(held: np.ndarray) -> float:
    return float(np.mean(held)) if held.size else NAN


def _std(held: np.ndarray) -> float:
    return float(np.std(held)) if held.size else NAN

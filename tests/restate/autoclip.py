"""autoclip and zscore_clip (smartclip's family) restated in float64, every history and mode."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.restate._common import COMMON, INF, NAN, _capped, _ceiling, _Log, _positive
from tests.restate.p2 import P2


def P2Median(p: float = 0.5) -> P2:
    """Textbook P² (clipjax's), incremental (:class:`tests.restate.p2.P2`)."""
    return P2(p, textbook=True)


class _Stats:
    """``raw_threshold``: the quantile, or ``center + z * std``."""

    center, z = "median", 3.0

    def raw_threshold(self) -> float:
        r = self.report()
        return r["quantile"] if "quantile" in r else r[self.center] + self.z * r["std"]


class _AutoStats(_Stats):
    """mode="auto": textbook P² median + Welford std (ddof=1, 0 with one sample)."""

    def __init__(self) -> None:
        self.p2 = P2Median()
        self.k, self.mean, self.m2 = 0, 0.0, 0.0

    def observe(self, x: float) -> None:
        self.p2.observe(x)
        self.k += 1
        delta = x - self.mean
        self.mean += delta / self.k
        self.m2 += delta * (x - self.mean)

    def report(self) -> dict[str, float]:
        if not self.k:
            return {"median": NAN, "std": NAN}
        std = math.sqrt(self.m2 / (self.k - 1)) if self.k > 1 else 0.0
        return {"median": self.p2.value(), "std": std}


class _WindowStats(_Stats):
    def __init__(self, percentile: float, window_size: int) -> None:
        self.p, self.w, self.xs = percentile, window_size, []

    def observe(self, x: float) -> None:
        self.xs = [*self.xs, x][-self.w :]

    def report(self) -> dict[str, float]:
        return {"quantile": float(np.percentile(self.xs, self.p)) if self.xs else NAN}


class _WindowMedianStats(_Stats):
    """mode="auto", history="window": numpy median and std (ddof=1, 0 with one
    value) of the last ``window_size`` observations."""

    def __init__(self, window_size: int) -> None:
        self.w, self.xs = window_size, []

    def observe(self, x: float) -> None:
        self.xs = [*self.xs, x][-self.w :]

    def report(self) -> dict[str, float]:
        if not self.xs:
            return {"median": NAN, "std": NAN}
        std = float(np.std(self.xs, ddof=1)) if len(self.xs) > 1 else 0.0
        return {"median": float(np.median(self.xs)), "std": std}


class _GeometricStats(_Stats):
    """The geometric quantile: start at the first value, ``q <- q exp(-lr (1[x <= q] - p))``."""

    def __init__(self, percentile: float, quantile_lr: float) -> None:
        self.p, self.lr, self.q = percentile / 100.0, quantile_lr, NAN

    def observe(self, x: float) -> None:
        if math.isnan(self.q):
            self.q = x
        else:
            self.q *= math.exp(-self.lr * (float(x <= self.q) - self.p))

    def report(self) -> dict[str, float]:
        return {"quantile": self.q}


class _ZScoreStats(_Stats):
    """EMA mean and variance, both starting at the first value."""

    center = "mean"

    def __init__(self, zmax: float, decay: float) -> None:
        self.z, self.d, self.m, self.s = zmax, decay, NAN, 0.0

    def observe(self, x: float) -> None:
        if math.isnan(self.m):
            self.m, self.s = x, 0.0
        else:
            d = self.d
            self.s = d * self.s + d * (1 - d) * (x - self.m) ** 2
            self.m = d * self.m + (1 - d) * x

    def report(self) -> dict[str, float]:
        if math.isnan(self.m):
            return {"mean": NAN, "std": NAN}
        return {"mean": self.m, "std": math.sqrt(max(0.0, self.s))}


def _smartclip_family(
    norms: Sequence[float],
    stats: Any,
    feedback: str,
    warmup_steps: int,
    min_history: int,
    eps: float,
    clipped_value: str,
    cap: float = INF,
) -> dict[str, np.ndarray]:
    """autoclip / zscore_clip with their feedback (one group); ``cap`` is
    the ceiling (``max_grad_norm``), ``capped`` is reported when it is finite.

    ``clipped_value`` is what ``feedback="clipped"`` observes on a fire:
    ``"T"`` (auto mode, zscore_clip) or ``"g"`` (percentile mode).
    """
    fields = COMMON + list(stats.report()) + (["capped"] if cap < INF else [])
    log = _Log(fields)
    gate = max(warmup_steps, min_history)
    for g in map(float, norms):
        if not math.isfinite(g):
            log.nonfinite(g, **stats.report())
            continue
        x = _positive(g, eps)
        if feedback == "observe_first":
            stats.observe(x)
            threshold = max(eps, stats.raw_threshold())
            open_ = log.count + 1 >= gate
            scale = min(1.0, threshold / (g + eps)) if open_ else 1.0
            log.add(g=g, threshold=threshold, scale=scale, observed=True, **stats.report())
            continue
        # Judge first: T from the statistics before this step; the gate counts the
        # observations before it (CONTRACT: >= max(warmup, min_history, 1)).
        # No observation yet, no statistics: T = +inf.
        raw = stats.raw_threshold()
        threshold = max(eps, raw) if not math.isnan(raw) else INF
        open_ = log.count >= max(gate, 1)
        scale = min(1.0, threshold / (g + eps)) if open_ else 1.0
        fires = open_ and scale < 1.0
        observed = True
        if fires and feedback == "skip":
            observed = False
        elif fires and feedback == "clipped" and clipped_value == "T":
            stats.observe(min(x, threshold))
        else:
            stats.observe(x)
        # The ceiling bounds every step, gate closed or open; the threshold
        # reported is the norm above which this step is clipped.
        scale, capped = _capped(g, scale, cap)
        if cap < INF:
            threshold = min(threshold, cap) if open_ else cap
        log.add(g, threshold, scale, observed, capped=capped, **stats.report())
    return log.out()


def autoclip(
    norms: Sequence[float],
    *,
    mode: str = "auto",
    percentile: float = 95.0,
    history: str | None = None,
    window_size: int | None = None,
    warmup_steps: int = 100,
    min_history: int = 50,
    eps: float = 1e-8,
    feedback: str = "observe_first",
    quantile_lr: float = 0.2,
    max_grad_norm: Any = "auto",
) -> dict[str, np.ndarray]:
    """autoclip, modes auto (history "all" / "window") / percentile window /
    percentile geometric (not ema). ``history=None`` in auto mode is the whole
    history under ``"observe_first"`` and the window otherwise."""
    if mode == "auto" and history is None:
        history = "all" if feedback == "observe_first" else "window"
    if window_size is None:
        window_size = 100 if mode == "auto" else 1024
    if mode == "auto" and history == "window":
        stats: Any = _WindowMedianStats(window_size)
    elif mode == "auto":
        stats = _AutoStats()
    elif history in (None, "window"):
        stats = _WindowStats(percentile, window_size)
    elif history == "geometric":
        stats = _GeometricStats(percentile, quantile_lr)
    else:
        raise ValueError(f"no restatement for history={history!r}")
    value = "T" if mode == "auto" else "g"
    cap = _ceiling(max_grad_norm, feedback)
    return _smartclip_family(norms, stats, feedback, warmup_steps, min_history, eps, value, cap)


def zscore_clip(
    norms: Sequence[float],
    *,
    zmax: float = 3.0,
    ema_decay: float | None = None,
    warmup_steps: int = 100,
    min_history: int = 50,
    eps: float = 1e-8,
    feedback: str = "observe_first",
    max_grad_norm: Any = "auto",
) -> dict[str, np.ndarray]:
    if ema_decay is None:
        ema_decay = 0.99 if feedback == "observe_first" else 0.97
    stats = _ZScoreStats(zmax, ema_decay)
    cap = _ceiling(max_grad_norm, feedback)
    return _smartclip_family(norms, stats, feedback, warmup_steps, min_history, eps, "T", cap)

"""hist_clip restated in float64, with ``warmup_clip=None``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tests.restate._common import COMMON, INF, NAN, _capped, _ceiling, _Log, _observation

_CLIP_FNS: dict[str, Callable[[float, float], float]] = {
    "max": lambda s, t: t,
    "reciprocal": lambda s, t: t * t / s,
    "mean": lambda s, t: 0.0,
}


def hist_clip(
    norms: Sequence[float],
    *,
    criterion: str = "zstat",
    alpha: float | None = None,
    thresh: float | None = None,
    clip: str | None = None,
    warmup_steps: int = 20,
    feedback: str = "raw",
    max_grad_norm: Any = "auto",
) -> dict[str, np.ndarray]:
    """hist_clip with ``warmup_clip=None`` (warm-up steps pass unchanged, but for
    the ceiling ``max_grad_norm``, which bounds every step)."""
    cap = _ceiling(max_grad_norm, feedback)
    zstat = criterion == "zstat"
    alpha = (0.97 if zstat else 0.98) if alpha is None else alpha
    thresh = (2.5 if zstat else 1.05) if thresh is None else thresh
    clip = ("reciprocal" if zstat else "max") if clip is None else clip
    f = _CLIP_FNS[clip]
    fields = ["clip_to", "mean", "std", "z"] if zstat else ["clip_to", "mean"]
    log = _Log(COMMON + fields + (["capped"] if cap < INF else []))
    samples: list[float] = []
    mu, v = 0.0, 1.0
    started = False

    def stats() -> dict[str, float]:
        return {"mean": mu, "std": math.sqrt(v)} if zstat else {"mean": mu}

    for g in map(float, norms):
        if not math.isfinite(g):
            log.nonfinite(g, **stats())
            continue
        if log.count < warmup_steps:
            samples.append(g)
            # The statistics reported on the step that completes the warm-up set are
            # not defined by the rule (drytorch still shows its initial 0 / 1.0 there,
            # clipjax may show them initialised): not compared.
            last = len(samples) == warmup_steps
            shown = {k: NAN for k in stats()} if last else stats()
            scale, capped = _capped(g, 1.0, cap)
            log.add(
                g=g,
                threshold=min(INF, cap),
                scale=scale,
                observed=True,
                z=0.0,
                clip_to=cap if capped else g,
                capped=capped,
                **shown,
            )
            continue
        if not started:
            started = True
            if samples:
                mu = float(np.mean(samples))
            if len(samples) > 1 and np.var(samples, ddof=1) > 0:
                v = float(np.var(samples, ddof=1))
        active = mu != 0
        if zstat:
            sd = math.sqrt(v)
            stat = abs((g - mu) / (sd + 1e-8))
            fires = active and stat > thresh
            clip_val = mu + f(stat, thresh) * sd if fires else NAN
        else:
            stat = g / mu if active else NAN
            fires = active and stat > thresh
            factor = 1.0 if clip == "mean" else (f(stat, thresh) if fires else NAN)
            clip_val = mu * factor
        if not active:
            boundary = INF
        elif zstat:
            boundary = mu + thresh * (math.sqrt(v) + 1e-8)
        else:
            boundary = mu * thresh
        scale = min(1.0, clip_val / (g + 1e-6)) if fires else 1.0
        high = fires and g > mu
        observed = not (high and feedback == "skip")
        if observed:
            x = _observation(feedback, g, boundary, clip_val, high)
            if zstat:
                v = alpha * v + (1 - alpha) * (x - mu) ** 2
            mu = alpha * mu + (1 - alpha) * x
        extra = {"z": stat} if zstat else {}
        to = clip_val if (high and scale < 1) else g
        scale, capped = _capped(g, scale, cap)
        log.add(
            g=g,
            threshold=min(boundary, cap),
            scale=scale,
            observed=observed,
            clip_to=cap if capped else to,
            capped=capped,
            **extra,
            **stats(),
        )
    return log.out()

"""zclip restated in float64."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tests.restate._common import (
    COMMON,
    INF,
    NAN,
    _capped,
    _Log,
    _observation,
)

_ZCLIP_DIV = 1e-6  # zclip's fixed guard in T / (g + 1e-6)


def zclip(
    norms: Sequence[float],
    *,
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    feedback: str = "clip_target",
) -> dict[str, np.ndarray]:
    """zclip; ``threshold`` is the boundary ``min(B, cap)``, ``clip_to`` the norm it leaves with."""
    cap = INF if max_grad_norm is None else float(max_grad_norm)
    log = _Log([*COMMON, "clip_to", "mean", "std", "z", *(["capped"] if cap < INF else [])])
    samples: list[float] = []
    mean = var = NAN

    def stats() -> dict[str, float]:
        if math.isnan(mean):
            return {"mean": NAN, "std": NAN}
        return {"mean": mean, "std": math.sqrt(var)}

    for g in map(float, norms):
        if not math.isfinite(g):
            log.nonfinite(g, **stats())
            continue
        if log.count < warmup_steps:
            samples.append(g)
            if len(samples) == warmup_steps:
                mean, var = float(np.mean(samples)), float(np.var(samples))
            scale = min(1.0, cap / (g + _ZCLIP_DIV))
            to = min(g, cap) if scale < 1 else g
            capped = _capped(g, 1.0, cap)[1]
            log.add(
                g=g,
                threshold=cap,
                scale=scale,
                observed=True,
                z=0.0,
                clip_to=to,
                capped=capped,
                **stats(),
            )
            continue
        std = math.sqrt(var)
        z = (g - mean) / (std + eps)
        if mode == "percentile":
            boundary = mean + z_thresh * std
            clip_val = boundary
            spike = g > boundary
        else:
            boundary = mean + z_thresh * (std + eps)
            spike = z > z_thresh
            if clip_option == "mean":
                clip_val = mean
            else:
                clip_val = clip_factor * (mean + z_thresh**2 * std / z) if spike else NAN
        applied = min(clip_val if spike else g, cap)
        scale = applied / (g + _ZCLIP_DIV) if g > applied else 1.0
        observed = not (spike and feedback == "skip")
        if observed:
            v = _observation(feedback, g, boundary, clip_val, spike)
            new_mean = alpha * mean + (1 - alpha) * v
            var = alpha * var + (1 - alpha) * (v - new_mean) ** 2
            mean = new_mean
        to = applied if scale < 1 else g
        threshold = min(boundary, cap)
        # The ceiling is the bound where it lies at or below the rule's clip value.
        capped = _capped(g, clip_val / (g + _ZCLIP_DIV) if spike else 1.0, cap)[1]
        log.add(
            g=g,
            threshold=threshold,
            scale=scale,
            observed=observed,
            z=z,
            clip_to=to,
            capped=capped,
            **stats(),
        )
    return log.out()

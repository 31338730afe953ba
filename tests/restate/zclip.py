"""zclip restated in float64."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tests.restate._common import COMMON, INF, NAN, _Log, _observation

_ZCLIP_DIV = 1e-6  # zclip's fixed guard in T / (g + 1e-6)


def zclip(
    norms: Sequence[float],
    *,
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | str | None = "auto",
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    feedback: str = "clip_target",
    relative_ceiling: float | str | None = "auto",
    ceiling_window: int = 100,
    start: str | None = "auto",
) -> dict[str, np.ndarray]:
    """zclip; ``threshold`` is the boundary ``min(B, ceiling)``, ``clip_to`` the norm it
    leaves with.

    ``"auto"`` ceilings: an absolute 1.0, except under ``feedback="clipped"``, where a
    relative ceiling of 1.5: every step bounded at 1.5 x the smallest positive norm so
    far during the warm-up, then 1.5 x the median of the last ``ceiling_window``
    positive norms; no absolute number anywhere (eps relative to the mean,
    multipliers T / g). ``start`` (``"auto"``: ``"hold"`` with a relative ceiling):
    ``"hold"`` marks the finite warm-up steps ``held`` and zeroes the first one that
    no norm bounds; ``"weight"`` weighs step t by ``min(1, (t + 1) / warmup_steps)``.
    """
    if max_grad_norm == "auto":
        max_grad_norm = None if feedback == "clipped" else 1.0
    if relative_ceiling == "auto":
        relative_ceiling = 1.5 if feedback == "clipped" and max_grad_norm is None else None
    cap = INF if max_grad_norm is None else float(max_grad_norm)
    relative = relative_ceiling is not None
    if start == "auto":
        start = "hold" if relative else None
    ceiling = cap < INF or relative
    fields = [*COMMON, "clip_to", "mean", "std", "z", *(["capped"] if ceiling else [])]
    log = _Log([*fields, *([{"hold": "held"}.get(start, start)] if start else [])])
    div = 0.0 if relative else _ZCLIP_DIV
    samples: list[float] = []
    window: list[float] = []
    low = INF
    mean = var = NAN

    def stats() -> dict[str, float]:
        if math.isnan(mean):
            return {"mean": NAN, "std": NAN}
        return {"mean": mean, "std": math.sqrt(var)}

    for g in map(float, norms):
        warming = log.count < warmup_steps
        limit = cap
        if relative and window:
            level = low if warming else float(np.median(window))
            limit = min(cap, float(relative_ceiling) * level)
        weight = min(1.0, (log.step + 1) / warmup_steps) if start == "weight" else 1.0
        extra = {"weight": 1.0} if start == "weight" else {"held": False} if start else {}
        if not math.isfinite(g):
            log.nonfinite(g, **stats(), **extra)
            continue
        if warming:
            samples.append(g)
            if len(samples) == warmup_steps:
                mean, var = float(np.mean(samples)), float(np.var(samples))
            rule = 1.0
            spike, clip_val, z, threshold, observed = False, NAN, 0.0, limit, True
            scale = min(1.0, limit / (g + div)) if g + div > 0 else 1.0
            applied = min(g, limit)
        else:
            std = math.sqrt(var)
            spread = std + (eps * mean if relative else eps)
            z = (g - mean) / spread if spread > 0 else (INF if g > mean else 0.0)
            if mode == "percentile":
                boundary = mean + z_thresh * std
                clip_val = boundary
                spike = g > boundary
            else:
                boundary = mean + z_thresh * (std + (eps * mean if relative else eps))
                spike = z > z_thresh
                if clip_option == "mean":
                    clip_val = mean
                else:
                    clip_val = clip_factor * (mean + z_thresh**2 * std / z) if spike else NAN
            applied = min(clip_val if spike else g, limit)
            scale = applied / (g + div) if g > applied else 1.0
            rule = clip_val / (g + div) if spike else 1.0
            threshold = min(boundary, limit)
            observed = not (spike and feedback == "skip")
            if observed:
                v = _observation(feedback, g, boundary, clip_val, spike)
                new_mean = alpha * mean + (1 - alpha) * v
                var = alpha * var + (1 - alpha) * (v - new_mean) ** 2
                mean = new_mean
        # The ceiling is the bound where it lies at or below the rule's own scale.
        capped = g > limit and limit / (g + div) <= rule
        scale *= weight
        held = start == "hold" and warming
        if held and relative and not window:
            scale = 0.0  # no norm seen yet bounds it
        if g > 0:
            window = [*window, g][-ceiling_window:]
            low = min(low, g)
        log.add(
            g=g,
            threshold=threshold,
            scale=scale,
            observed=observed,
            z=z,
            clip_to=(scale * (g + div) if start else applied) if scale < 1 else g,
            capped=capped,
            **stats(),
            **({"weight": weight} if start == "weight" else {"held": held} if start else {}),
        )
    return log.out()

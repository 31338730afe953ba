"""adagc restated in float64, per group."""

from __future__ import annotations

import math

import numpy as np

from tests.restate._common import COMMON, INF, _Log


def adagc(
    norms: np.ndarray,
    *,
    relative_threshold: float = 1.05,
    beta: float = 0.98,
    warmup_steps: int = 100,
    absolute_threshold: float = 1.0,
    eps: float = 1e-6,
    feedback: str = "clipped",
) -> dict[str, np.ndarray]:
    """``norms`` is ``[steps, groups]``; every field comes back ``[steps, groups]``."""
    x = np.asarray(norms, np.float64)
    steps, groups = x.shape
    logs = [_Log([*COMMON, "mean"]) for _ in range(groups)]
    gamma = [INF] * groups
    for t in range(steps):
        row = [float(v) for v in x[t]]
        big_g = math.sqrt(sum(v * v for v in row if math.isfinite(v)))
        h = min(1.0, absolute_threshold / (big_g + eps))
        for i, g in enumerate(row):
            log = logs[i]
            if not math.isfinite(g):
                log.nonfinite(g, mean=gamma[i])
                continue
            if log.count < warmup_steps:
                gamma[i] = min(gamma[i], h * g)
                log.add(g=g, threshold=absolute_threshold, scale=h, observed=True, mean=gamma[i])
                continue
            threshold = relative_threshold * gamma[i]
            scale = min(1.0, threshold / (g + eps))
            fires = scale < 1.0
            observed = not (fires and feedback == "skip")
            if observed:
                obs = scale * g if feedback == "clipped" else g
                # Without a warm-up, gamma starts at the first norm (+inf until then).
                ema = beta * gamma[i] + (1 - beta) * obs
                gamma[i] = min(gamma[i], obs) if math.isinf(gamma[i]) else ema
            log.add(g=g, threshold=threshold, scale=scale, observed=observed, mean=gamma[i])
    outs = [log.out() for log in logs]
    return {k: np.stack([o[k] for o in outs], axis=1) for k in outs[0]}

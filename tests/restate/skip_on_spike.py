"""skip_on_spike restated in float64: the decision, the thresholds and the buffers."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.skip_streams import MIN_HISTORY, SIGMA, WINDOW


def skip_on_spike(
    norms: list[float],
    values: list[float] | None,
    *,
    window: int = WINDOW,
    sigma: float = SIGMA,
    min_history: int = MIN_HISTORY,
    max_consecutive_skips: int | None = None,
    feedback: str = "clipped",
) -> list[dict[str, Any]]:
    """The rule in float64 NumPy, step by step: decision, thresholds, buffers after.

    ``feedback``: what enters a buffer, for a finite value x with threshold
    T: ``"clipped"`` min(x, T) on every step (x itself on a forced step);
    ``"skip"`` x on taken steps only; ``"raw"`` x on every step.
    """
    grad_buffer: list[float] = []
    value_buffer: list[float] = []
    seen = {"grad": 0, "value": 0}
    consecutive = 0
    out = []

    def observe(buffer: list[float], key: str, x: float, th: float, skip: bool, forced: bool):
        if not np.isfinite(x) or (feedback == "skip" and skip):
            return buffer
        if feedback == "clipped" and not forced:
            x = min(x, th)
        seen[key] += 1
        return [*buffer, x][-window:]

    def threshold(buffer: list[float]) -> float:
        if len(buffer) < min_history:
            return np.inf
        return float(np.mean(buffer) + sigma * np.std(buffer))  # population std

    for t, g in enumerate(norms):
        v = None if values is None else values[t]
        grad_threshold = threshold(grad_buffer)
        value_threshold = np.inf if v is None else threshold(value_buffer)
        finite = np.isfinite(g) and (v is None or np.isfinite(v))
        spike = g > grad_threshold or (v is not None and v > value_threshold)
        forced = False
        if max_consecutive_skips is not None and consecutive >= max_consecutive_skips:
            forced = finite and spike
            spike = False
        skip = not finite or spike
        consecutive = consecutive + 1 if skip else 0
        grad_buffer = observe(grad_buffer, "grad", g, grad_threshold, skip, forced)
        if v is not None:
            value_buffer = observe(value_buffer, "value", v, value_threshold, skip, forced)
        out.append(
            {
                "skipped": skip,
                "grad_seen": seen["grad"],
                "value_seen": seen["value"],
                "grad_threshold": grad_threshold,
                "value_threshold": value_threshold,
                "consecutive_skips": consecutive,
                "grad_buffer": list(grad_buffer),
                "value_buffer": list(value_buffer),
                # how far from the boundary: float32 and float64 agree when large
                "margin": min(
                    abs(x - th) / abs(th)
                    for x, th in ((g, grad_threshold), (v, value_threshold))
                    if x is not None and np.isfinite(x) and np.isfinite(th)
                )
                if np.isfinite(grad_threshold) and np.isfinite(g)
                else np.inf,
            }
        )
    return out

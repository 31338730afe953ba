"""AXLearn's ``skip_and_clip_by_global_norm`` restated in NumPy, from the published code.

apple/axlearn at commit 34aed43c1b6e581c4753d06d7cbeedd5010ef26b,
``axlearn/common/optimizers.py``: ``skip_and_clip_by_global_norm`` (``init_fn``,
``update_fn`` with ``_moment``, ``_stddev`` and ``_is_valid_step``),
``drop_norm_by_grad_norm_ema`` and ``drop_norm_by_grad_norm_stddev``, walked over a
sequence of global norms.

``fix=False`` is the published code (EMAs starting at 1, ``std = (m2 - mean**2) **
0.5``, every non-finite norm counted against every threshold), in ``dtype``
(float64 by default; float32 is what AXLearn runs). ``fix=True`` applies what
clipjax changes and documents: no threshold before the first observed norm, the
variance by its recursion, a non-finite norm counted in ``nonfinite_count`` only;
and clipjax's ``feedback`` (``"skip"`` is AXLearn's).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.restate._common import NAN


def ema_rule(multipliers: tuple = (20, 40, 100)) -> Any:
    """``drop_norm_by_grad_norm_ema``."""
    return lambda count, mean, stddev: {f"{v}x_mean": mean * v for v in multipliers}


def stddev_rule(min_count: int = 500, multipliers: tuple = (20, 40, 100)) -> Any:
    """``drop_norm_by_grad_norm_stddev`` (1e10 before ``min_count``; clipjax: +inf)."""
    return lambda count, mean, stddev: {
        f"{v}x_stddev": (1e10 if count < min_count else mean + stddev * v) for v in multipliers
    }


def skip_and_clip(
    norms: Any,
    *,
    drop_norm: Any = None,
    max_norm: float | None = None,
    decay: float | None = None,
    eps: float = 1e-8,
    feedback: str = "skip",
    fix: bool = True,
    dtype: Any = np.float64,
) -> dict[str, np.ndarray]:
    """Per step: ``grad_norm``, ``skipped``, ``drop_norm`` (the smallest threshold),
    ``scale`` (the clip of a taken step, 1 on a dropped one), ``clipped``, the counters
    (``count``: the observed norms, ``skipped_count``, ``nonfinite_count``,
    ``clipped_count``, ``step``), ``count_exceeds_{name}`` per threshold, and ``mean``,
    ``std`` after the step (NaN before the first observation: not compared)."""
    adaptive = callable(drop_norm)
    f = lambda x: dtype(x)
    names = list(drop_norm(f(1), f(1), f(0))) if adaptive else []
    if drop_norm is not None and not adaptive:
        names = ["drop_norm"]
    count, nonvalid, nonfinite, clipped_count, step = 0, 0, 0, 0, 0
    mean = f(0.0 if fix else 1.0)
    second = f(0.0 if fix else 1.0)  # fix: the variance; else the EMA of the squares
    stats = dict.fromkeys(names, 0)
    rows: dict[str, list] = {}

    def add(**row: Any) -> None:
        for k, v in row.items():
            rows.setdefault(k, []).append(v)

    with np.errstate(invalid="ignore", over="ignore"):
        for g in np.asarray(norms, np.float64):
            g = f(g)
            finite = bool(np.isfinite(g))
            if adaptive:
                std = np.sqrt(second) if fix else (second - mean * mean) ** f(0.5)
                thresholds = {k: f(v) for k, v in drop_norm(count, mean, std).items()}
                if fix and count == 0:
                    thresholds = dict.fromkeys(thresholds, f(math.inf))
                if fix:  # clipjax's +inf for AXLearn's 1e10 before min_count
                    thresholds = {k: f(math.inf) if v == 1e10 else v for k, v in thresholds.items()}
            elif drop_norm is not None:
                thresholds = {"drop_norm": f(drop_norm)}
            else:
                thresholds = {}
            valid = finite
            for k, v in thresholds.items():
                less = bool(g < v)
                valid = valid and less
                stats[k] += int(not less and (finite or not fix))
            boundary = min(thresholds.values(), default=f(math.inf))
            # Before the first observation AXLearn judges by its EMAs' start at 1,
            # clipjax by nothing (+inf): the decision is compared, this value not.
            # So is AXLearn's 1e10 before min_count (clipjax: +inf).
            unset = adaptive and not fix and (count == 0 or boundary >= 1e10)
            reported = NAN if unset else float(boundary)
            dropped = finite and not valid
            # What the EMAs observe (AXLearn: a valid step's norm).
            if feedback == "skip":
                x, observed = g, valid
            elif feedback == "raw":
                x, observed = g, finite
            else:
                x, observed = (min(g, boundary) if dropped else g), finite
            if adaptive and observed:
                one = f(1)  # every operand a `dtype` scalar: NumPy 1.x would widen a Python one
                d = f(decay) * (one - f(decay) ** f(count)) / (one - f(decay) ** f(count + 1))
                if fix:
                    second = d * second + d * (one - d) * (x - mean) * (x - mean)
                    mean = d * mean + (one - d) * x
                else:
                    mean, second = d * mean + (one - d) * x, d * second + (one - d) * x * x
            count += int(observed)
            nonvalid += int(not valid)
            nonfinite += int(not finite)
            scale = 1.0
            if max_norm is not None and valid:
                scale = min(1.0, max_norm / (float(g) + eps))
            clipped_count += int(scale < 1)
            step += 1
            std_after = float(np.sqrt(second) if fix else (second - mean * mean) ** f(0.5))
            add(
                grad_norm=float(g), skipped=not valid, drop_norm=reported, scale=scale,
                clipped=scale < 1, count=count, skipped_count=nonvalid,
                nonfinite_count=nonfinite, clipped_count=clipped_count, step=step,
                mean=float(mean) if adaptive and (count or not fix) else NAN,
                std=std_after if adaptive and (count or not fix) else NAN,
                **{f"count_exceeds_{k}": stats[k] for k in names},
            )  # fmt: skip
    return {k: np.asarray(v) for k, v in rows.items()}

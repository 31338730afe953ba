"""torchzero's growth-capped clips restated in float64 NumPy, from the published code.

inikishev/torchzero at commit 2b6a2287df3aec9e7801249a691088f958c15ed9:
``norm_growth_clip_`` and ``ClipNormGrowth.multi_tensor_apply`` in
``torchzero/modules/clipping/growth_clipping.py``; ``ClipNormByEMA.multi_tensor_update``
and ``multi_tensor_apply`` in ``torchzero/modules/clipping/ema_clipping.py``.

``fix=False`` is the published code line by line (its NaN handling is Python's and
torch's: comparisons with NaN are False). ``fix=True`` applies what clipjax changes
and documents: a non-finite norm is not observed and passes unchanged; the first
norm is floored at ``min_value``; ``denom = max(denom, min_value)`` is left out.
``feedback`` other than ``"clipped"`` (torchzero's rule) restates clipjax's options.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.restate._common import COMMON, NAN, _Log


def clip_norm_growth(
    norms: Any,
    *,
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
    feedback: str = "clipped",
    fix: bool = True,
) -> dict[str, np.ndarray]:
    """One group's norms through ``norm_growth_clip_``: the per-step log (``COMMON``
    fields and ``prev_norm`` after the step)."""
    log = _Log([*COMMON, "prev_norm"])
    with np.errstate(divide="ignore", invalid="ignore"):
        _growth_steps(log, np.asarray(norms, np.float64), add, mul, min_value, max_decay,
                      feedback, fix)  # fmt: skip
    return log.out()


def _growth_steps(
    log: _Log, norms: np.ndarray, add: Any, mul: Any, min_value: Any, max_decay: Any,
    feedback: str, fix: bool,
) -> None:  # fmt: skip
    prev = None
    for g in norms:  # np.float64: x / 0 is inf, as torch's
        if fix and not math.isfinite(g):
            log.nonfinite(g, prev_norm=0.0 if prev is None else prev)
            continue
        if prev is None:
            # The first step: prev_norm = norm, nothing clipped.
            prev = max(g, min_value) if (fix and min_value is not None) else g
            log.add(g=g, threshold=math.inf, scale=1.0, observed=True, prev_norm=prev)
            continue
        denom = np.float64(1.0)
        allowed_min = math.inf
        if add is not None:
            allowed = prev + add
            allowed_min = min(allowed_min, allowed)
            if g > allowed:
                denom = g / allowed
        if mul is not None:
            allowed = prev * mul
            allowed_min = min(allowed_min, allowed)
            if g > allowed:
                denom = max(denom, g / allowed)
        if min_value is not None and not fix:
            denom = max(denom, min_value)
        inverse = 1 / denom
        fires = denom > 1
        observed = not (feedback == "skip" and fires)
        new_prev = g if feedback == "raw" else g / denom
        if max_decay is not None:
            decay = g / np.float64(prev)
            if decay < (1 / max_decay):
                new_prev = prev / max_decay
        if min_value is not None:
            new_prev = max(new_prev, min_value)  # Python's max: a NaN first stays NaN
        if observed:
            prev = new_prev
        log.add(g=g, threshold=allowed_min, scale=inverse, observed=observed, prev_norm=prev)


def clip_norm_by_ema(
    updates: list[dict[str, np.ndarray]],
    *,
    beta: float = 0.99,
    max_ema_growth: float | None = 1.5,
    init: float = 0.0,
    min_norm: float = 1e-6,
    tensorwise: bool = True,
    fix: bool = True,
) -> tuple[list[dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """``ClipNormByEMA`` on a sequence of update trees (``{name: array}``), float64.

    Returns the clipped updates per step and, per group (each tensor, or
    ``"global"``), ``threshold`` (the EMA's norm after the cap), ``scale`` and
    ``grad_norm`` per step. ``fix=True``: a group whose norm is not finite passes
    unchanged and its EMA stays (``threshold`` NaN there: not compared).
    """
    names = sorted(updates[0])
    tiny = 2 * np.finfo(np.float32).tiny  # torch.finfo(float32).tiny * 2
    exp_avg = {k: np.full(np.shape(updates[0][k]), init, np.float64) for k in names}
    groups = names if tensorwise else ["global"]
    members = {k: [k] for k in names} if tensorwise else {"global": names}
    prev: dict[str, float] = {}
    out: list[dict[str, np.ndarray]] = []
    log = {k: {"grad_norm": [], "threshold": [], "scale": []} for k in groups}
    for u in updates:
        u = {k: np.asarray(v, np.float64) for k, v in u.items()}
        result = {}
        for group in groups:
            leaves = members[group]
            norm = math.sqrt(sum(float(np.sum(u[k] ** 2)) for k in leaves))
            if fix and not math.isfinite(norm):
                for k in leaves:
                    result[k] = u[k]
                log[group]["grad_norm"].append(norm)
                log[group]["threshold"].append(NAN)
                log[group]["scale"].append(1.0)
                continue
            moved = {k: exp_avg[k] + (1 - beta) * (u[k] - exp_avg[k]) for k in leaves}  # lerp_
            ema_norm = math.sqrt(sum(float(np.sum(moved[k] ** 2)) for k in leaves))
            if max_ema_growth is not None:
                before = prev.get(group, ema_norm)  # initialised to this step's norm
                allowed = max(before * max_ema_growth, min_norm)
                ema_denom = max(ema_norm / allowed, 1.0)
                moved = {k: v / ema_denom for k, v in moved.items()}
                ema_norm = ema_norm / ema_denom
                prev[group] = ema_norm
            exp_avg.update(moved)
            denom = max(norm / max(ema_norm, tiny), 1.0)
            for k in leaves:
                result[k] = u[k] / denom
            log[group]["grad_norm"].append(norm)
            log[group]["threshold"].append(max(ema_norm, tiny))
            log[group]["scale"].append(1 / denom)
        out.append(result)
    return out, {g: {k: np.asarray(v) for k, v in rows.items()} for g, rows in log.items()}

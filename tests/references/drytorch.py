"""drytorch's ``HistClipper`` / ``ParamHistClipper`` on one or several torch parameters."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.references._common import (
    _INF,
    _NAN,
    _finalize,
    _grad_np,
    _measured_scale,
    _set_grad,
    _torch_dtype,
    _unit_vector,
)

_CRITERIA = ("zstat", "ema")
_CLIPS = ("reciprocal", "max", "mean")


def _recording_criterion(go: Any, criterion: str, log: dict[int, dict[str, Any]], **kw: Any):
    """A drytorch criterion that logs, under ``log[id(self)]`` (copies too:
    ParamHistClipper), ``fired``, ``stat`` (pre-update z or ratio) and ``clip``."""
    base = go.ZStatCriterion if criterion == "zstat" else go.EMACriterion

    class _Rec(base):
        def should_clip(self, value: float) -> bool:
            if isinstance(self, go.ZStatCriterion):
                denom = math.sqrt(self._v_t) + self._eps if self._v_t >= 0 else _NAN
                try:
                    stat = (value - self._mu_t) / denom
                except ZeroDivisionError:
                    stat = _NAN
            else:
                stat = value / self._mu_t if self._mu_t != 0.0 else _NAN
            fired = super().should_clip(value)
            log[id(self)] = {"fired": bool(fired), "stat": stat, "clip": None}
            return fired

        def get_clip_value(self, value: float) -> float:
            cv = super().get_clip_value(value)
            log.setdefault(id(self), {"fired": None, "stat": _NAN})["clip"] = cv
            return cv

    return _Rec(**kw)


def drytorch_reference(
    norms: np.ndarray,
    criterion: str = "zstat",
    clip: str | None = None,
    alpha: float | None = None,
    z_thresh: float = 2.5,
    r_thresh: float = 1.05,
    n_warmup_steps: int = 20,
    warmup_max_norm: float | None = 1.0,
    per_param: bool = False,
    *,
    dtype: Any = "float64",
    n_elem: int = 4,
) -> dict[str, np.ndarray]:
    """drytorch's ``HistClipper`` (or ``ParamHistClipper``, ``per_param``) on ``norms``.

    ``criterion="zstat"``: ``ZStatCriterion(alpha (0.97), z_thresh, f)``, ``clip`` default
    ``"reciprocal"``; ``"ema"``: ``EMACriterion(alpha (0.98), r_thresh, f)``, default
    ``"max"``; warm-up ``GradNormClipper(warmup_max_norm)``, ``NoOp()`` when None.
    ``norms`` ``[steps]`` or ``[steps, params]``: each parameter a ``dtype`` vector of
    ``n_elem`` whose grad is ``norm * u``; together one global group, or a group each with
    ``per_param`` (fields then ``[steps, params]``). Fields: ``warmup`` (the first
    ``n_warmup_steps`` calls, NaN included; the next sets the statistics from them,
    ddof-1 variance if > 0 else 1.0, and is judged); ``fired`` (``should_clip`` on the
    pre-update statistics; zstat also on the low side); ``threshold``
    (``get_clip_value`` when fired, else +inf); ``z`` / ``ratio`` (pre-update, NaN in the
    warm-up); ``hist_scale`` (``scale``, 1.0 on warm-up steps); ``warmup_threshold`` (NaN
    after the warm-up); ``mean``, zstat ``var`` and ``std`` after the step (drytorch's
    initial 0 and 1.0 during the warm-up); ``n_collected``; ``finite_out``.
    """
    import torch
    from drytorch.lib import gradient_ops as go

    if criterion not in _CRITERIA:
        raise ValueError(f"criterion must be one of {_CRITERIA}")
    if clip is None:
        clip = "reciprocal" if criterion == "zstat" else "max"
    if clip not in _CLIPS:
        raise ValueError(f"clip must be one of {_CLIPS}")
    x2 = np.asarray(norms, dtype=np.float64)
    x2 = x2[:, None] if x2.ndim == 1 else x2
    if x2.ndim != 2:
        raise ValueError(f"norms must be 1-D or 2-D, got shape {np.shape(norms)}")
    n_steps, n_params = x2.shape
    n_groups = n_params if per_param else 1

    log: dict[int, dict[str, Any]] = {}
    ckw: dict[str, Any] = {"clipping_function": getattr(go, f"{clip}_clipping")}
    ckw.update({} if alpha is None else {"alpha": alpha})
    ckw.update({"z_thresh": z_thresh} if criterion == "zstat" else {"r_thresh": r_thresh})
    crit = _recording_criterion(go, criterion, log, **ckw)
    warm = go.NoOp() if warmup_max_norm is None else go.GradNormClipper(warmup_max_norm)
    cls = go.ParamHistClipper if per_param else go.HistClipper
    clipper = cls(criterion=crit, warmup_clip_strategy=warm, n_warmup_steps=n_warmup_steps)

    tdt = _torch_dtype(dtype)
    u = _unit_vector(n_elem)
    params = [torch.nn.Parameter(torch.zeros(n_elem, dtype=tdt)) for _ in range(n_params)]
    warm_thr = _INF if warmup_max_norm is None else float(warmup_max_norm)
    stat_name = "z" if criterion == "zstat" else "ratio"

    keys = [
        "grad_norm", "warmup", "fired", "threshold", stat_name, "scale", "hist_scale",
        "warmup_threshold", "mean", "n_collected", "finite_out",
    ]  # fmt: skip
    if criterion == "zstat":
        keys += ["var", "std"]
    out: dict[str, list] = {k: [] for k in keys}

    def _crit_for(i: int) -> Any:
        return clipper._dict_criterion[id(params[i])] if per_param else crit

    def _handler_for(i: int) -> Any:
        return clipper._dict_warmup_handler[id(params[i])] if per_param else clipper._warmup_handler

    for t in range(n_steps):
        for i, p in enumerate(params):
            _set_grad(p, float(x2[t, i]), u)
        befores = [_grad_np(p) for p in params]
        if per_param:
            gns = [p.grad.norm(2, dtype=float).item() for p in params]
        else:
            gns = [math.sqrt(sum((p.grad**2).sum().item() for p in params))]
        warm_flags = [_handler_for(j).active and not len(_handler_for(j)) >= n_warmup_steps
                      for j in range(n_groups)]  # fmt: skip
        log.clear()
        with torch.no_grad():
            clipper(params)
        afters = [_grad_np(p) for p in params]

        row: dict[str, list] = {k: [] for k in keys}
        for j in range(n_groups):
            c = _crit_for(j)
            entry = log.get(id(c))
            w = warm_flags[j]
            if per_param:
                b, a = befores[j], afters[j]
            else:
                b, a = np.concatenate(befores), np.concatenate(afters)
            sc = _measured_scale(b, a)
            fired = bool(entry["fired"]) if entry is not None else False
            row["grad_norm"].append(gns[j])
            row["warmup"].append(w)
            row["fired"].append(fired)
            clip_v = entry.get("clip") if entry is not None else None
            row["threshold"].append(float(clip_v) if fired and clip_v is not None else _INF)
            row[stat_name].append(_NAN if entry is None else float(entry["stat"]))
            row["scale"].append(sc)
            row["hist_scale"].append(1.0 if w else sc)
            row["warmup_threshold"].append(warm_thr if w else _NAN)
            row["mean"].append(float(c._mu_t))
            if criterion == "zstat":
                row["var"].append(float(c._v_t))
                row["std"].append(math.sqrt(c._v_t) if c._v_t >= 0 else _NAN)
            row["n_collected"].append(len(_handler_for(j)))
            row["finite_out"].append(bool(np.all(np.isfinite(a))))
        for k in keys:
            out[k].append(row[k] if per_param else row[k][0])
    return _finalize(out)

"""``zclip.ZClip`` on a one-parameter torch module."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.references._common import (
    _INF,
    _NAN,
    _as_1d,
    _finalize,
    _grad_np,
    _measured_scale,
    _opt,
    _set_grad,
    _torch_dtype,
    _unit_vector,
)


def zclip_reference(
    norms: np.ndarray, *, dtype: Any = "float64", n_elem: int = 4, **kwargs: Any
) -> dict[str, np.ndarray]:
    """``zclip.ZClip(**kwargs)`` on a one-parameter torch module (``n_elem`` entries of
    ``dtype``, grad ``norm * u``, then ``zc.step``); NB zclip's default ``max_grad_norm=1.0``
    caps every step after the warm-up.

    Fields: ``grad_norm`` (``zc.step``'s); ``warmup`` (``not zc.initialized`` as the step
    began: the step completing the warm-up set is one); ``threshold`` (warm-up: the cap,
    +inf when None; later ``_apply_clipping``'s ``min(clip_val or grad_norm, cap)``, the
    norm itself on an unflagged step); ``clip_val``, ``spike``, ``z`` (pre-step
    statistics; NaN / False in the warm-up); ``mean``, ``var``, ``std`` after the step (NaN
    while not initialised); ``initialized``; ``finite_out``; ``error`` (the repr of what
    ``zc.step`` raised, the numeric fields NaN then).
    """
    import torch
    import zclip

    x = _as_1d(norms)
    tdt = _torch_dtype(dtype)
    u = _unit_vector(n_elem)

    class _Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(n_elem, dtype=tdt))

    model = _Holder()
    param = model.w
    zc = zclip.ZClip(**kwargs)

    rec: dict[str, Any] = {}
    orig_apply = zc._apply_clipping
    orig_clip_val = zc._compute_clip_val

    def _apply_clipping(model_: Any, clip_val: Any, total_norm: float) -> Any:
        eff = orig_apply(model_, clip_val, total_norm)
        rec["threshold"] = eff
        return eff

    def _compute_clip_val(grad_norm: float) -> Any:
        rec["z"] = zc._compute_positive_zscore(grad_norm)[0]
        cv = orig_clip_val(grad_norm)
        rec["clip_val"] = cv
        return cv

    zc._apply_clipping = _apply_clipping
    zc._compute_clip_val = _compute_clip_val

    keys = (
        "grad_norm", "warmup", "threshold", "clip_val", "spike", "z", "scale",
        "mean", "var", "std", "initialized", "finite_out", "error",
    )  # fmt: skip
    out: dict[str, list] = {k: [] for k in keys}
    mgn = kwargs.get("max_grad_norm", 1.0)
    warm_thr = _INF if mgn is None else float(mgn)
    for g in x:
        _set_grad(param, float(g), u)
        before = _grad_np(param)
        rec.clear()
        was_warmup = not zc.initialized
        err = ""
        try:
            with torch.no_grad():
                gn = zc.step(model)
        except Exception as e:  # record and go on
            err = repr(e)
            gn = _NAN
        after = _grad_np(param)
        out["grad_norm"].append(float(gn))
        out["warmup"].append(was_warmup)
        if err:
            thr = _NAN
        elif was_warmup:
            thr = warm_thr
        else:
            thr = float(rec.get("threshold", _NAN))
        out["threshold"].append(thr)
        cv = rec.get("clip_val")
        out["clip_val"].append(_opt(cv))
        out["spike"].append((not was_warmup) and ("clip_val" in rec) and cv is not None)
        out["z"].append(_opt(rec.get("z")))
        out["scale"].append(_NAN if err else _measured_scale(before, after))
        mean = zc.mean
        var = zc.var
        out["mean"].append(_opt(mean))
        out["var"].append(_opt(var))
        out["std"].append(_NAN if var is None else (math.sqrt(var) if var >= 0 else _NAN))
        out["initialized"].append(bool(zc.initialized))
        out["finite_out"].append(bool(np.all(np.isfinite(after))))
        out["error"].append(err)
    res = _finalize(out)
    res["error"] = np.asarray(out["error"], dtype=object)
    return res

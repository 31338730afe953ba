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
    """Run ``zclip.ZClip(**kwargs)`` on a one-parameter torch module.

    The module holds one ``torch.nn.Parameter`` of ``n_elem`` entries of
    ``dtype`` (default float64, to isolate algorithm differences from
    rounding; ``"float32"`` or a ``torch.dtype`` also work). Each step its
    ``.grad`` is set to ``norms[t] * u`` with ``u`` a fixed unit vector
    (entries ``±1/sqrt(n_elem)``), then ``zc.step(module)`` is called.
    ``kwargs`` go to ``ZClip`` unchanged; NB zclip's default
    ``max_grad_norm=1.0`` also caps every step after warm-up.

    Returned fields (all ``[steps]``):

    * ``grad_norm``: the value ``zc.step`` returned (zclip's own norm, in
      the parameter dtype).
    * ``warmup``: the step went through zclip's warm-up branch (``not
      zc.initialized`` when the step began). The step that completes
      ``warmup_steps`` collected norms is a warm-up step; the statistics are
      initialised at its end.
    * ``threshold``: warm-up steps: ``max_grad_norm`` (+inf when None; the
      step is clipped by ``torch.nn.utils.clip_grad_norm_(max_grad_norm)``).
      Later steps: the return value of ``zc._apply_clipping``, i.e.
      ``min(clip_val if clip_val is not None else grad_norm, max_grad_norm)``
      (no ``min`` when ``max_grad_norm`` is None) -- so it equals ``grad_norm``
      on an unflagged step below ``max_grad_norm``.
    * ``clip_val``: ``zc._compute_clip_val(grad_norm)`` from the pre-step
      statistics (NaN when it returned None, and on warm-up steps).
    * ``spike``: ``clip_val is not None`` (False on warm-up steps).
    * ``z``: ``zc._compute_positive_zscore(grad_norm)[0]`` =
      ``(g - mean)/(sqrt(var) + eps)`` from the pre-step statistics,
      evaluated in both modes; NaN on warm-up steps.
    * ``scale``: measured (module docstring); after warm-up it is
      ``T / (g + 1e-6)`` when ``g > T`` else 1.
    * ``mean``, ``var``, ``std``: ``zc.mean``, ``zc.var``, ``sqrt(zc.var)``
      after the step (NaN while not initialised). The update uses
      ``clip_val`` on a spike, else ``g``; mean first, then var with the new
      mean.
    * ``initialized``: ``zc.initialized`` after the step.
    * ``finite_out``: the gradient after the step is all finite.
    * ``error``: the repr of an exception raised by ``zc.step`` (the step's
      numeric fields are NaN then), else ``""``.
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

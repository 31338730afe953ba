"""Drivers that run the reference packages themselves on a sequence of norms.

Differential tests compare clipjax step by step against what the reference
implementations do when fed the same sequence of gradient norms:

* :func:`smartclip_autoclip`, :func:`smartclip_zscore` -- smartclip's pure
  Python core objects (``smartclip.AutoClip`` / ``smartclip.ZScoreClip``),
  driven exactly as smartclip's JAX backend drives them for ``scope="global"``
  (``smartclip/backends/jax/__init__.py``, ``apply_grads``). No torch needed.
* :func:`zclip_reference` -- ``zclip.ZClip`` on a one-parameter torch module.
* :func:`drytorch_reference` -- ``drytorch.lib.gradient_ops.HistClipper`` /
  ``ParamHistClipper`` on one or several torch parameters.

Every driver takes a 1-D array of norms (``drytorch_reference`` also a 2-D
``[steps, params]`` array) that may contain NaN/Inf, and returns a ``dict`` of
numpy arrays whose first axis is the step. The fields every driver returns:

``grad_norm`` (float64)
    The norm the reference itself saw that step, before clipping (for torch
    references: the value its own norm computation produced; equal to the input
    up to a few ulp of the parameter dtype).
``threshold`` (float64)
    The threshold / clip value of that step; defined per driver below. NaN
    where the reference has none.
``scale`` (float64)
    The multiplier applied to the gradient that step. smartclip: the value of
    the backend's formula. torch references: *measured*,
    ``||g_after||_2 / ||g_before||_2`` computed in float64 from the gradient
    tensors (1.0 when ``||g_before|| == 0``). When the input norm is non-finite
    the multiplier is unobservable from the tensors; then ``scale`` is 1.0 when
    the gradient came out unchanged (elementwise, NaN equal to NaN) and NaN
    otherwise, and ``finite_out`` says whether the output gradient is finite.
``clipped`` (bool)
    ``scale < 1`` (False for NaN scale).

Statistics fields (``mean``, ``std``, ``var``, ``median``, ``quantile``) are
read from the reference objects' attributes *after* the step (post-update), as
clipjax reports them; NaN where the reference holds none (``None``).

``torch`` (and the torch-based references) are imported lazily, inside the
drivers, so ``import references`` works without torch; use
:func:`have_torch` etc. to decide whether to skip.

Norm-sequence generators: :func:`spikes`, :func:`regime_shift`,
:func:`constant`, :func:`with_nan`. All return float64 numpy arrays.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "constant",
    "drytorch_reference",
    "have_drytorch",
    "have_smartclip",
    "have_torch",
    "have_zclip",
    "p2_restated",
    "regime_shift",
    "smartclip_autoclip",
    "smartclip_zscore",
    "spikes",
    "with_nan",
    "zclip_reference",
]

_NAN = float("nan")
_INF = float("inf")


# ----------------------------------------------------------------------------
# Availability helpers
# ----------------------------------------------------------------------------


def _have(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def have_torch() -> bool:
    """True when ``torch`` is importable (zclip and drytorch need it)."""
    return _have("torch")


def have_smartclip() -> bool:
    """True when ``smartclip`` is importable (pure Python, no torch needed)."""
    return _have("smartclip")


def have_zclip() -> bool:
    """True when both ``torch`` and ``zclip`` are importable."""
    return have_torch() and _have("zclip")


def have_drytorch() -> bool:
    """True when both ``torch`` and ``drytorch`` are importable."""
    return have_torch() and _have("drytorch")


# ----------------------------------------------------------------------------
# Norm-sequence generators
# ----------------------------------------------------------------------------

SPIKE_FACTORS: tuple[float, ...] = (10.0, 100.0, 1000.0, 30.0)


def spikes(
    n: int = 400,
    seed: int = 0,
    *,
    noise: float = 0.1,
    factors: Sequence[float] = SPIKE_FACTORS,
    at: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A stationary stream around 1 with a few large spikes.

    ``base[t] = exp(noise * N(0, 1))`` (``numpy.random.default_rng(seed)``),
    median 1, then ``norms[at[i]] = base[at[i]] * factors[i]``.

    Args:
      n: number of steps.
      seed: RNG seed (deterministic).
      noise: log-normal noise level.
      factors: spike multipliers (default ×10, ×100, ×1000, ×30).
      at: spike steps; default ``round(linspace(0.3, 0.8, len(factors)) * n)``
        (n=400: 120, 187, 253, 320 -- all after smartclip's default 100-step
        gate, zclip's 25 and drytorch's 20 warm-up steps).

    Returns:
      ``(norms, spike_idx)``: float64 ``[n]`` positive norms and the int64
      spike indices (sorted as given).
    """
    rng = np.random.default_rng(seed)
    x = np.exp(noise * rng.standard_normal(n)).astype(np.float64)
    factors = np.asarray(factors, dtype=np.float64)
    if at is None:
        idx = np.round(np.linspace(0.3, 0.8, len(factors)) * n).astype(np.int64)
    else:
        idx = np.asarray(at, dtype=np.int64)
    if idx.shape != factors.shape:
        raise ValueError("`at` and `factors` must have the same length")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError("spike index out of range")
    x[idx] *= factors
    return x, idx


def regime_shift(
    n: int = 600, seed: int = 0, factor: float = 0.2, *, noise: float = 0.1
) -> np.ndarray:
    """A stationary stream whose level is multiplied by ``factor`` halfway.

    ``norms[t] = level[t] * exp(noise * N(0, 1))`` with ``level[t] = 1`` for
    ``t < n // 2`` and ``factor`` from step ``n // 2`` on. float64 ``[n]``.
    """
    rng = np.random.default_rng(seed)
    x = np.exp(noise * rng.standard_normal(n)).astype(np.float64)
    x[n // 2 :] *= factor
    return x


def constant(n: int = 200, value: float = 1.0) -> np.ndarray:
    """``n`` copies of ``value`` (float64)."""
    return np.full(n, value, dtype=np.float64)


def with_nan(norms: np.ndarray, at: int | Sequence[int] = 70, value: float = _NAN) -> np.ndarray:
    """A float64 copy of ``norms`` with ``value`` (default NaN; +inf works too) at ``at``."""
    out = np.array(norms, dtype=np.float64, copy=True)
    out[np.asarray(at)] = value
    return out


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _as_1d(norms: Any) -> np.ndarray:
    x = np.asarray(norms, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"norms must be 1-D, got shape {x.shape}")
    return x


def _opt(v: float | None) -> float:
    return _NAN if v is None else float(v)


def _measured_scale(before: np.ndarray, after: np.ndarray) -> float:
    """Multiplier from two gradient snapshots (float64); see module docstring."""
    nb = float(np.linalg.norm(before))
    if math.isfinite(nb):
        if nb == 0.0:
            return 1.0
        return float(np.linalg.norm(after)) / nb
    return 1.0 if np.array_equal(before, after, equal_nan=True) else _NAN


def _unit_vector(n_elem: int) -> np.ndarray:
    """Fixed unit vector ``sign_i / sqrt(n_elem)``, signs alternating +, -.

    With ``n_elem`` a power of 4 (default 4: ``±0.5``) the entries are exact
    binary fractions, so ``||norm * u||`` reproduces ``norm`` to ~1 ulp.
    """
    if n_elem < 1:
        raise ValueError("n_elem must be >= 1")
    signs = np.where(np.arange(n_elem) % 2 == 0, 1.0, -1.0)
    return signs / math.sqrt(n_elem)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return {"float64": torch.float64, "float32": torch.float32}[str(np.dtype(dtype))]


def _set_grad(param: Any, norm: float, u: np.ndarray) -> None:
    import torch

    with np.errstate(invalid="ignore", over="ignore"):
        g = norm * u
    param.grad = torch.tensor(g, dtype=param.dtype)


def _grad_np(param: Any) -> np.ndarray:
    return param.grad.detach().double().numpy().copy()


def _finalize(out: dict[str, list]) -> dict[str, np.ndarray]:
    res = {}
    for k, v in out.items():
        arr = np.asarray(v)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float64)
        res[k] = arr
    if "scale" in res:
        res["clipped"] = res["scale"] < 1.0
    return res


# ----------------------------------------------------------------------------
# smartclip
# ----------------------------------------------------------------------------


def _smartclip_scale(clipper: Any, g: float, threshold: float) -> float:
    """The global-scope scale of ``smartclip/backends/jax/__init__.py`` (apply_grads)."""
    if not clipper.can_clip():
        return 1.0
    denom = float(g) + clipper.eps
    return 1.0 if denom <= threshold else max(threshold / denom, 0.0)


def smartclip_autoclip(norms: np.ndarray, **kwargs: Any) -> dict[str, np.ndarray]:
    """Run ``smartclip.AutoClip(**kwargs)`` on ``norms`` as its JAX backend does (global scope).

    Per step ``t`` with ``g = float(norms[t])``, key ``("global",)``:
    ``clipper.observe(g)``; ``T = clipper.threshold()``; then
    ``scale = 1`` if not ``clipper.can_clip()`` else
    ``1.0 if g + eps <= T else max(T / (g + eps), 0.0)``.

    ``kwargs`` are forwarded unchanged (``mode``, ``percentile``, ``history``,
    ``window_size``, ``ema_decay``, ``warmup_steps``, ``min_history``,
    ``eps``, ``guard_nans``). NB smartclip's default ``history`` is ``"ema"``
    (clipjax's is ``"window"``): pass ``history="window"`` explicitly to compare.
    ``scope`` must be (and defaults to) ``"global"``.

    Returned fields (all ``[steps]``):

    * ``grad_norm``: ``g`` (the input, float64).
    * ``threshold``: ``clipper.threshold()`` after observing ``g``: computed
      every step, also while the gate is closed, floored at ``eps`` by
      smartclip (``T = eps`` when the statistic is undefined: auto mode with
      fewer than 5 observations, or no observation yet).
    * ``scale``: as above (NaN for a NaN ``g`` once the gate is open, 0.0 for
      ``g = +inf``: smartclip's ``max(nan, 0.0)`` is nan).
    * ``clipped``: ``scale < 1``.
    * ``can_clip``: the gate after the observation
      (``steps >= warmup_steps and observations >= min_history``).
    * ``count``: the gate's observation count after the step (guarded
      non-finite norms are not counted).
    * ``mode="auto"``: ``median`` = P² marker ``q[2]`` (``P2Quantile.value``;
      NaN below 5 observations); ``mean``, ``var``, ``std`` = Welford mean,
      ddof-1 variance and its sqrt (NaN below 1 / 2 / 2 observations).
    * ``mode="percentile"``: ``quantile`` = the estimator's raw value, before
      the ``eps`` floor: ``history="window"``: linearly interpolated percentile
      of the last ``window_size`` observations (``RollingWindow.percentile``);
      ``history="ema"``: ``EmaQuantile.value``. NaN before the first
      observation. ``history="window"`` also gives ``window_len``.

    Non-finite ``g``: with ``guard_nans=True`` (default) ``observe`` returns
    early, nothing is updated or counted, ``T`` is the previous threshold.
    With ``guard_nans=False`` smartclip's ``ensure_positive(v, eps)``
    (``v if v > 0 else eps``) turns NaN and -inf into ``eps`` *before* it
    enters the statistics, while +inf enters as +inf.
    """
    import smartclip

    x = _as_1d(norms)
    kwargs = dict(kwargs)
    if kwargs.setdefault("scope", "global") != "global":
        raise ValueError("only scope='global' is driven here")
    clipper = smartclip.AutoClip(**kwargs)
    key = ("global",)
    mode = clipper._mode
    hist = clipper._history_mode
    out: dict[str, list] = {"grad_norm": [], "threshold": [], "scale": [], "can_clip": []}
    out["count"] = []
    if mode == "auto":
        for k in ("median", "mean", "var", "std"):
            out[k] = []
    else:
        out["quantile"] = []
        if hist == "window":
            out["window_len"] = []
    for g in x:
        g = float(g)
        clipper.observe(g, key=key)
        t = clipper.threshold(key)
        out["grad_norm"].append(g)
        out["threshold"].append(t)
        out["scale"].append(_smartclip_scale(clipper, g, t))
        out["can_clip"].append(bool(clipper.can_clip()))
        out["count"].append(int(clipper._gate.observations))
        if mode == "auto":
            p2 = clipper._p2_by_key.get(key)
            w = clipper._welford_by_key.get(key)
            out["median"].append(_opt(p2.value if p2 is not None else None))
            out["mean"].append(_opt(w.mean if w is not None else None))
            out["var"].append(_opt(w.variance if w is not None else None))
            out["std"].append(_opt(w.std if w is not None else None))
        elif hist == "window":
            win = clipper._win_by_key.get(key)
            n = len(win) if win is not None else 0
            q = win.percentile(clipper._percentile) if n else None
            out["quantile"].append(_opt(q))
            out["window_len"].append(n)
        else:
            est = clipper._ema_by_key.get(key)
            out["quantile"].append(_opt(est.value if est is not None else None))
    return _finalize(out)


def smartclip_zscore(norms: np.ndarray, **kwargs: Any) -> dict[str, np.ndarray]:
    """Run ``smartclip.ZScoreClip(**kwargs)`` on ``norms`` as its JAX backend does (global scope).

    Same driving loop and ``scale`` formula as :func:`smartclip_autoclip`;
    ``kwargs`` (``zmax``, ``ema_decay``, ``warmup_steps``, ``min_history``,
    ``eps``, ``guard_nans``) are forwarded.

    Returned fields (all ``[steps]``):

    * ``grad_norm``, ``scale``, ``clipped``, ``can_clip``, ``count``: as in
      :func:`smartclip_autoclip`.
    * ``threshold``: ``clipper.threshold()`` after observing ``g``:
      ``max(eps, m + zmax * std)`` (``ensure_positive``), also while the gate
      is closed; ``eps`` before the first observation.
    * ``mean``, ``std``: ``clipper.stats()`` after the step, i.e. the EMA
      ``m`` of x and ``sqrt(max(0, m2 - m**2))`` with ``m2`` the EMA of x²
      (both EMAs start at the first observation, no bias correction).
      ``stats()`` returns ``(0.0, 0.0)`` before the first observation; this
      driver reports NaN there instead.
    * ``var``: ``max(0, m2 - m**2)`` (``EmaMoments.variance()``), NaN before
      the first observation.
    """
    import smartclip

    x = _as_1d(norms)
    kwargs = dict(kwargs)
    if kwargs.setdefault("scope", "global") != "global":
        raise ValueError("only scope='global' is driven here")
    clipper = smartclip.ZScoreClip(**kwargs)
    key = ("global",)
    out: dict[str, list] = {
        k: []
        for k in ("grad_norm", "threshold", "scale", "can_clip", "count", "mean", "std", "var")
    }
    for g in x:
        g = float(g)
        clipper.observe(g, key=key)
        t = clipper.threshold(key)
        out["grad_norm"].append(g)
        out["threshold"].append(t)
        out["scale"].append(_smartclip_scale(clipper, g, t))
        out["can_clip"].append(bool(clipper.can_clip()))
        out["count"].append(int(clipper._gate.observations))
        mom = clipper._moments_by_key.get(key)
        if mom is None:
            out["mean"].append(_NAN)
            out["std"].append(_NAN)
            out["var"].append(_NAN)
        else:
            m, s = clipper.stats(key)
            out["mean"].append(m)
            out["std"].append(s)
            out["var"].append(_opt(mom.variance()))
    return _finalize(out)


# ----------------------------------------------------------------------------
# zclip
# ----------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------
# drytorch
# ----------------------------------------------------------------------------

_CRITERIA = ("zstat", "ema")
_CLIPS = ("reciprocal", "max", "mean")


def _recording_criterion(go: Any, criterion: str, log: dict[int, dict[str, Any]], **kw: Any):
    """An instance of a drytorch criterion subclass that logs its decisions.

    ``log[id(self)]`` gets ``fired`` (should_clip), ``stat`` (z or ratio from
    the pre-update statistics) and ``clip`` (get_clip_value, when called). The
    log dict is shared by ``copy.copy`` (ParamHistClipper), entries are keyed
    by the id of the criterion copy.
    """
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
    """Run drytorch's ``HistClipper`` (or ``ParamHistClipper``) on ``norms``.

    Setup: ``criterion="zstat"`` -> ``ZStatCriterion(alpha, z_thresh, f)``
    (``alpha`` default 0.97, ``clip`` default ``"reciprocal"``);
    ``criterion="ema"`` -> ``EMACriterion(alpha, r_thresh, f)`` (``alpha``
    default 0.98, ``clip`` default ``"max"``); ``f`` is
    ``{reciprocal,max,mean}_clipping``. Warm-up strategy
    ``GradNormClipper(warmup_max_norm)``, or ``NoOp()`` when None.
    ``per_param=False``: ``HistClipper``; ``True``: ``ParamHistClipper``.

    ``norms``: 1-D ``[steps]`` (one parameter) or 2-D ``[steps, params]``
    (several parameters: with ``per_param=False`` they form one global group
    whose norm is ``sqrt(sum_i norms[t, i]**2)``; with ``per_param=True`` each
    column is an independent group). Each parameter is a float64 (``dtype``)
    vector of ``n_elem`` entries whose ``.grad`` is set to ``norms[t, i] * u``
    every step, then ``clipper(params)`` is called.

    Returned fields: ``[steps]`` for ``per_param=False``, ``[steps, params]``
    for ``per_param=True`` (per-group values):

    * ``grad_norm``: the norm drytorch computes that step (global:
      ``sqrt(sum((grad**2).sum().item()))``; per param:
      ``grad.norm(2, dtype=float).item()``).
    * ``warmup``: the step went through the warm-up branch: the first
      ``n_warmup_steps`` calls (norm collected -- NaN included --, warm-up
      strategy applied, criterion neither evaluated nor updated). On the next
      call drytorch sets ``set_statistics(mean, ddof-1 variance)`` (variance
      only if > 0, and 1.0 with fewer than 2 samples) and evaluates the
      criterion in that same call; that step has ``warmup=False``.
    * ``fired``: ``criterion.should_clip(g)`` (pre-update statistics; False
      while ``mu == 0`` and on warm-up steps). zstat fires on ``|z| > z_thresh``
      (also on the low side); ema on ``g/mu > r_thresh``.
    * ``threshold``: ``criterion.get_clip_value(g)`` evaluated before the
      update when ``fired``, else +inf (also +inf on warm-up steps). zstat:
      ``mu + f(|z|, z_thresh) * sqrt(v)``; ema: ``mu * f(g/mu, r_thresh)``
      (``mean_clipping`` gives 0 there, which zeroes the gradient).
    * ``z`` (zstat) / ``ratio`` (ema): ``(g - mu)/(sqrt(v) + 1e-8)`` /
      ``g / mu`` from the pre-update statistics (NaN on warm-up steps; ratio
      NaN while ``mu == 0``).
    * ``scale``: measured total multiplier of that parameter group (module
      docstring), including the warm-up clip on warm-up steps. After warm-up a
      fired step has ``min(1, threshold / (g + 1e-6))`` (torch
      ``clip_grad_norm_``), an unfired one exactly 1.
    * ``hist_scale``: ``scale`` on non-warm-up steps, 1.0 on warm-up steps
      (what clipjax's hist_clip reports as its own scale).
    * ``warmup_threshold``: ``warmup_max_norm`` (+inf when None) on warm-up
      steps, NaN otherwise.
    * ``mean``: ``criterion._mu_t`` after the step (drytorch's initial 0.0
      during warm-up). zstat also ``var`` = ``criterion._v_t`` (initial 1.0
      during warm-up) and ``std = sqrt(var)``. Update order: zstat
      ``v <- a*v + (1-a)*(g - mu_old)**2`` then ``mu <- a*mu + (1-a)*g``;
      ema ``mu <- a*mu + (1-a)*g``; always with the raw ``g``.
    * ``n_collected``: warm-up samples collected so far (after the step).
    * ``finite_out``: the group's gradient after the step is all finite.
    """
    import torch
    from drytorch.lib import gradient_ops as go

    if criterion not in _CRITERIA:
        raise ValueError(f"criterion must be one of {_CRITERIA}")
    if clip is None:
        clip = "reciprocal" if criterion == "zstat" else "max"
    if clip not in _CLIPS:
        raise ValueError(f"clip must be one of {_CLIPS}")
    clip_fn = {
        "reciprocal": go.reciprocal_clipping,
        "max": go.max_clipping,
        "mean": go.mean_clipping,
    }[clip]

    x = np.asarray(norms, dtype=np.float64)
    if x.ndim == 1:
        x2 = x[:, None]
    elif x.ndim == 2:
        x2 = x
    else:
        raise ValueError(f"norms must be 1-D or 2-D, got shape {x.shape}")
    n_steps, n_params = x2.shape

    log: dict[int, dict[str, Any]] = {}
    ckw: dict[str, Any] = {"clipping_function": clip_fn}
    if alpha is not None:
        ckw["alpha"] = alpha
    if criterion == "zstat":
        ckw["z_thresh"] = z_thresh
    else:
        ckw["r_thresh"] = r_thresh
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
            warm_flags = [_handler_for(i).active and not len(_handler_for(i)) >= n_warmup_steps
                          for i in range(n_params)]  # fmt: skip
        else:
            gns = [math.sqrt(sum((p.grad**2).sum().item() for p in params))]
            warm_flags = [clipper._warmup_handler.active and
                          not len(clipper._warmup_handler) >= n_warmup_steps]  # fmt: skip
        log.clear()
        with torch.no_grad():
            clipper(params)
        afters = [_grad_np(p) for p in params]

        n_groups = n_params if per_param else 1
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


class P2:
    """P² (Jain & Chlamtac 1985) in float64 Python, one observation at a time.

    ``textbook=False`` is smartclip's ``core/stats.py`` P2Quantile: its parabolic
    step without the ``1/(n[i+1]-n[i-1])`` factor, NaN before 5 observations.
    ``textbook=True`` is clipjax's (a FIX): the textbook formula, and the exact
    median of the observations so far before 5.
    """

    def __init__(self, p: float = 0.5, textbook: bool = True) -> None:
        self.p, self.textbook = p, textbook
        self.xs: list[float] = []
        self.q: list[float] = []
        self.n: list[int] = []
        self.nd: list[float] = []
        self.dn = [0.0, p / 2, p, (1 + p) / 2, 1.0]

    def observe(self, x: float) -> None:
        p, q, n = self.p, self.q, self.n
        if len(self.xs) < 5:
            self.xs.append(float(x))
            if len(self.xs) == 5:
                self.q = sorted(self.xs)
                self.n = [0, 1, 2, 3, 4]
                self.nd = [0.0, 2 * p, 4 * p, 2 + 2 * p, 4.0]
            return
        if x < q[0]:
            q[0], k = x, 0
        elif x < q[1]:
            k = 0
        elif x < q[2]:
            k = 1
        elif x < q[3]:
            k = 2
        elif x <= q[4]:
            k = 3
        else:
            q[4], k = x, 3
        for i in range(k + 1, 5):
            n[i] += 1
        for i in range(5):
            self.nd[i] += self.dn[i]
        for i in range(1, 4):
            d = self.nd[i] - n[i]
            if (d >= 1 and n[i + 1] - n[i] > 1) or (d <= -1 and n[i - 1] - n[i] < -1):
                s = 1 if d >= 1 else -1
                factor = s / (n[i + 1] - n[i - 1]) if self.textbook else s
                qp = q[i] + factor * (
                    (n[i] - n[i - 1] + s) * (q[i + 1] - q[i]) / (n[i + 1] - n[i])
                    + (n[i + 1] - n[i] - s) * (q[i] - q[i - 1]) / (n[i] - n[i - 1])
                )
                if q[i - 1] < qp < q[i + 1]:
                    q[i] = qp
                else:
                    q[i] = q[i] + s * (q[i + s] - q[i]) / (n[i + s] - n[i])
                n[i] += s

    def value(self) -> float:
        if len(self.xs) == 5:
            return self.q[2]
        if not self.textbook or not self.xs:
            return math.nan
        return float(np.median(self.xs))


def p2_restated(xs: Sequence[float], p: float = 0.5, textbook: bool = False) -> np.ndarray:
    """:class:`P2`'s value after each observation of ``xs``."""
    p2 = P2(p, textbook)
    out = []
    for x in xs:
        p2.observe(float(x))
        out.append(p2.value())
    return np.array(out)

"""smartclip's pure Python ``AutoClip`` and ``ZScoreClip`` cores, driven as its JAX
backend drives them for ``scope="global"``. No torch needed."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.references._common import (
    _NAN,
    _as_1d,
    _finalize,
    _opt,
)


def _smartclip_scale(clipper: Any, g: float, threshold: float) -> float:
    """The global-scope scale of ``smartclip/backends/jax/__init__.py`` (apply_grads)."""
    if not clipper.can_clip():
        return 1.0
    denom = float(g) + clipper.eps
    return 1.0 if denom <= threshold else max(threshold / denom, 0.0)


_KEY = ("global",)


def _global_clipper(cls: Any, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)`` at ``scope="global"``, the one scope these drivers drive."""
    kwargs = dict(kwargs)
    if kwargs.setdefault("scope", "global") != "global":
        raise ValueError("only scope='global' is driven here")
    return cls(**kwargs)


def _observe(clipper: Any, g: float, out: dict[str, list]) -> None:
    """Observes ``g``, then appends what every driver records: ``grad_norm``,
    ``threshold``, ``scale``, ``can_clip`` and ``count``."""
    clipper.observe(g, key=_KEY)
    t = clipper.threshold(_KEY)
    out["grad_norm"].append(g)
    out["threshold"].append(t)
    out["scale"].append(_smartclip_scale(clipper, g, t))
    out["can_clip"].append(bool(clipper.can_clip()))
    out["count"].append(int(clipper._gate.observations))


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
    clipper = _global_clipper(smartclip.AutoClip, kwargs)
    key = _KEY
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
        _observe(clipper, float(g), out)
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
    clipper = _global_clipper(smartclip.ZScoreClip, kwargs)
    key = _KEY
    out: dict[str, list] = {
        k: []
        for k in ("grad_norm", "threshold", "scale", "can_clip", "count", "mean", "std", "var")
    }
    for g in x:
        _observe(clipper, float(g), out)
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

"""smartclip's pure Python ``AutoClip`` and ``ZScoreClip`` cores, driven as its JAX
backend drives them for ``scope="global"``. No torch needed."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.references._common import _NAN, _as_1d, _finalize, _opt


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
    """``smartclip.AutoClip(**kwargs)`` (``scope="global"``) as its JAX backend drives it:
    ``observe(g)``, ``T = threshold()``, ``scale`` 1 while the gate is closed, else ``1 if
    g + eps <= T else max(T / (g + eps), 0)`` (NaN for a NaN ``g``, 0 for +inf). NB
    smartclip's default ``history`` is ``"ema"``, clipjax's ``"window"``.

    Fields: ``threshold`` (every step, floored at eps: eps while the statistic is
    undefined), ``can_clip``, ``count`` (the gate's observations); auto mode ``median``
    (P² ``q[2]``, NaN below 5), ``mean``, ``var``, ``std`` (Welford, ddof 1); percentile
    mode ``quantile`` (before the eps floor) and, for the window, ``window_len``.
    ``guard_nans=True`` skips a non-finite ``g`` (``T`` unchanged); ``False`` turns NaN and
    -inf into eps before the statistics, +inf enters as +inf.
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
    """``smartclip.ZScoreClip(**kwargs)`` driven as :func:`smartclip_autoclip`: ``threshold``
    ``max(eps, m + zmax * std)``; ``mean``, ``std``, ``var = max(0, m2 - m**2)`` from EMAs
    of x and x² that start at the first observation (no bias correction; NaN before it)."""
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

"""Float64 NumPy restatements of the adaptive rules (feedback, geometric quantile, adagc).

Written from the rules as the docstrings and the papers state them, not from
clipjax's code: each function walks a sequence of group norms step by
step in float64 Python and returns what clipjax must report, per step:

``grad_norm``, ``threshold``, ``scale``, ``clipped``, ``count``, ``step``,
``clipped_count``, ``nonfinite_count`` and the algorithm's statistics
(after the step's update). A value no rule defines (a threshold before
any observation, a threshold on a non-finite step) is NaN here and is not
compared (see :func:`compare`).

Every "clipper" function takes a 1-D float sequence of norms (NaN/Inf allowed)
and a ``feedback`` in ``"observe_first"``, ``"raw"``, ``"clipped"``,
``"clip_target"`` (zclip, hist_clip), ``"skip"``. ``threshold`` is the spike
boundary on every step; zclip and hist_clip also give
``clip_to``, the norm a step leaves with.
:func:`adagc` takes ``[steps, groups]`` (its warm-up uses the global norm).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import clipjax
from tests import references

NAN = math.nan
INF = math.inf
RTOL = 3e-5  # float32 clipjax vs a float64 restatement
# z = (g - mean) / std is a difference quotient: near z = 0 its float32 error is
# absolute, about ulp(g) / std = 6e-8 / 0.01..0.1 (measured up to 9e-6 on the
# noise-0.1 streams), not relative. Only ``z`` gets this absolute slack.
Z_ATOL = 5e-5


# ----------------------------------------------------------------------------
# Bookkeeping shared by every restatement
# ----------------------------------------------------------------------------


class _Log:
    """Per-step records plus the counters (count, step, clipped_count, nonfinite_count)."""

    def __init__(self, fields: Sequence[str]) -> None:
        self.rows: dict[str, list] = {k: [] for k in fields}
        self.count = self.step = self.clipped_count = self.nonfinite_count = 0

    def add(self, *, g: float, threshold: float, scale: float, observed: bool, **stats) -> None:
        finite = math.isfinite(g)
        self.step += 1
        self.count += int(observed)
        self.nonfinite_count += int(not finite)
        clipped = scale < 1.0
        self.clipped_count += int(clipped)
        row = dict(
            grad_norm=g,
            threshold=threshold,
            scale=scale,
            clipped=clipped,
            count=self.count,
            step=self.step,
            clipped_count=self.clipped_count,
            nonfinite_count=self.nonfinite_count,
            **stats,
        )
        for k, v in self.rows.items():
            v.append(row.get(k, NAN))

    def out(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.rows.items()}


COMMON = [
    "grad_norm",
    "threshold",
    "scale",
    "clipped",
    "count",
    "step",
    "clipped_count",
    "nonfinite_count",
]


_CEILING_DIV = 1e-6  # the guard of a ceiling's multiplier, max_grad_norm / (g + 1e-6)


def _ceiling(max_grad_norm: Any, feedback: str) -> float:
    """``max_grad_norm="auto"``: 1.0 under feedback "clipped", no ceiling otherwise."""
    if max_grad_norm == "auto":
        return 1.0 if feedback == "clipped" else INF
    return INF if max_grad_norm is None else float(max_grad_norm)


def _capped(g: float, scale: float, cap: float) -> tuple[float, bool]:
    """A rule's ``scale`` bounded by the ceiling ``cap``: ``(scale, capped)``."""
    if not (math.isfinite(g) and g > cap):
        return scale, False
    bound = cap / (g + _CEILING_DIV)
    return min(scale, bound), bound <= scale


def _positive(g: float, eps: float) -> float:
    """What smartclip-style statistics observe: ``g if g > 0 else eps``."""
    return g if g > 0 else eps


# ----------------------------------------------------------------------------
# autoclip / zscore_clip
# ----------------------------------------------------------------------------


def P2Median(p: float = 0.5) -> references.P2:
    """Textbook P² (clipjax's), incremental (``references.P2``)."""
    return references.P2(p, textbook=True)


class _AutoStats:
    """mode="auto": textbook P² median + Welford std (ddof=1, 0 with one sample)."""

    def __init__(self) -> None:
        self.p2 = P2Median()
        self.k, self.mean, self.m2 = 0, 0.0, 0.0

    def observe(self, x: float) -> None:
        self.p2.observe(x)
        self.k += 1
        delta = x - self.mean
        self.mean += delta / self.k
        self.m2 += delta * (x - self.mean)

    def report(self) -> dict[str, float]:
        if not self.k:
            return {"median": NAN, "std": NAN}
        std = math.sqrt(self.m2 / (self.k - 1)) if self.k > 1 else 0.0
        return {"median": self.p2.value(), "std": std}

    def raw_threshold(self) -> float:
        r = self.report()
        return r["median"] + 3.0 * r["std"]


class _WindowStats:
    def __init__(self, percentile: float, window_size: int) -> None:
        self.p, self.w, self.xs = percentile, window_size, []

    def observe(self, x: float) -> None:
        self.xs = [*self.xs, x][-self.w :]

    def report(self) -> dict[str, float]:
        return {"quantile": float(np.percentile(self.xs, self.p)) if self.xs else NAN}

    def raw_threshold(self) -> float:
        return self.report()["quantile"]


class _WindowMedianStats:
    """mode="auto", history="window": numpy median and std (ddof=1, 0 with one
    value) of the last ``window_size`` observations."""

    def __init__(self, window_size: int) -> None:
        self.w, self.xs = window_size, []

    def observe(self, x: float) -> None:
        self.xs = [*self.xs, x][-self.w :]

    def report(self) -> dict[str, float]:
        if not self.xs:
            return {"median": NAN, "std": NAN}
        std = float(np.std(self.xs, ddof=1)) if len(self.xs) > 1 else 0.0
        return {"median": float(np.median(self.xs)), "std": std}

    def raw_threshold(self) -> float:
        r = self.report()
        return r["median"] + 3.0 * r["std"]


class _GeometricStats:
    """The geometric quantile: start at the first value, ``q <- q exp(-lr (1[x <= q] - p))``."""

    def __init__(self, percentile: float, quantile_lr: float) -> None:
        self.p, self.lr, self.q = percentile / 100.0, quantile_lr, NAN

    def observe(self, x: float) -> None:
        if math.isnan(self.q):
            self.q = x
        else:
            self.q *= math.exp(-self.lr * (float(x <= self.q) - self.p))

    def report(self) -> dict[str, float]:
        return {"quantile": self.q}

    def raw_threshold(self) -> float:
        return self.q


class _ZScoreStats:
    """EMA mean and variance, both starting at the first value."""

    def __init__(self, zmax: float, decay: float) -> None:
        self.zmax, self.d, self.m, self.s = zmax, decay, NAN, 0.0

    def observe(self, x: float) -> None:
        if math.isnan(self.m):
            self.m, self.s = x, 0.0
        else:
            d = self.d
            self.s = d * self.s + d * (1 - d) * (x - self.m) ** 2
            self.m = d * self.m + (1 - d) * x

    def report(self) -> dict[str, float]:
        if math.isnan(self.m):
            return {"mean": NAN, "std": NAN}
        return {"mean": self.m, "std": math.sqrt(max(0.0, self.s))}

    def raw_threshold(self) -> float:
        r = self.report()
        return r["mean"] + self.zmax * r["std"]


def _smartclip_family(
    norms: Sequence[float],
    stats: Any,
    feedback: str,
    warmup_steps: int,
    min_history: int,
    eps: float,
    clipped_value: str,
    cap: float = INF,
) -> dict[str, np.ndarray]:
    """autoclip / zscore_clip with their feedback (one group); ``cap`` is
    the ceiling (``max_grad_norm``), ``capped`` is reported when it is finite.

    ``clipped_value`` is what ``feedback="clipped"`` observes on a fire:
    ``"T"`` (auto mode, zscore_clip) or ``"g"`` (percentile mode).
    """
    fields = COMMON + list(stats.report()) + (["capped"] if cap < INF else [])
    log = _Log(fields)
    gate = max(warmup_steps, min_history)
    for g in map(float, norms):
        if not math.isfinite(g):
            # A non-finite norm: nothing observed, scale 1; the threshold on such a step is
            # not defined by the rule (NaN here: not compared).
            log.add(g=g, threshold=NAN, scale=1.0, observed=False, capped=False, **stats.report())
            continue
        x = _positive(g, eps)
        if feedback == "observe_first":
            stats.observe(x)
            threshold = max(eps, stats.raw_threshold())
            open_ = log.count + 1 >= gate
            scale = min(1.0, threshold / (g + eps)) if open_ else 1.0
            log.add(g=g, threshold=threshold, scale=scale, observed=True, **stats.report())
            continue
        # Judge first: T from the statistics before this step; the gate counts the
        # observations before it (CONTRACT: >= max(warmup, min_history, 1)).
        # No observation yet, no statistics: T = +inf.
        raw = stats.raw_threshold()
        threshold = max(eps, raw) if not math.isnan(raw) else INF
        open_ = log.count >= max(gate, 1)
        scale = min(1.0, threshold / (g + eps)) if open_ else 1.0
        fires = open_ and scale < 1.0
        observed = True
        if fires and feedback == "skip":
            observed = False
        elif fires and feedback == "clipped" and clipped_value == "T":
            stats.observe(min(x, threshold))
        else:
            stats.observe(x)
        # The ceiling bounds every step, gate closed or open; the threshold
        # reported is the norm above which this step is clipped.
        scale, capped = _capped(g, scale, cap)
        if cap < INF:
            threshold = min(threshold, cap) if open_ else cap
        log.add(
            g=g,
            threshold=threshold,
            scale=scale,
            observed=observed,
            capped=capped,
            **stats.report(),
        )
    return log.out()


def autoclip(
    norms: Sequence[float],
    *,
    mode: str = "auto",
    percentile: float = 95.0,
    history: str | None = None,
    window_size: int | None = None,
    quantile_lr: float = 0.2,
    warmup_steps: int = 100,
    min_history: int = 50,
    eps: float = 1e-8,
    feedback: str = "observe_first",
    max_grad_norm: Any = "auto",
) -> dict[str, np.ndarray]:
    """autoclip, modes auto (history "all" / "window") / percentile window /
    percentile geometric (not ema). ``history=None`` in auto mode is the whole
    history under ``"observe_first"`` and the window otherwise."""
    if mode == "auto" and history is None:
        history = "all" if feedback == "observe_first" else "window"
    if window_size is None:
        window_size = 100 if mode == "auto" else 1024
    if mode == "auto" and history == "window":
        stats: Any = _WindowMedianStats(window_size)
    elif mode == "auto":
        stats = _AutoStats()
    elif history in (None, "window"):
        stats = _WindowStats(percentile, window_size)
    elif history == "geometric":
        stats = _GeometricStats(percentile, quantile_lr)
    else:
        raise ValueError(f"no restatement for history={history!r}")
    value = "T" if mode == "auto" else "g"
    cap = _ceiling(max_grad_norm, feedback)
    return _smartclip_family(norms, stats, feedback, warmup_steps, min_history, eps, value, cap)


def zscore_clip(
    norms: Sequence[float],
    *,
    zmax: float = 3.0,
    ema_decay: float | None = None,
    warmup_steps: int = 100,
    min_history: int = 50,
    eps: float = 1e-8,
    feedback: str = "observe_first",
    max_grad_norm: Any = "auto",
) -> dict[str, np.ndarray]:
    if ema_decay is None:
        ema_decay = 0.99 if feedback == "observe_first" else 0.97
    stats = _ZScoreStats(zmax, ema_decay)
    cap = _ceiling(max_grad_norm, feedback)
    return _smartclip_family(norms, stats, feedback, warmup_steps, min_history, eps, "T", cap)


# ----------------------------------------------------------------------------
# zclip
# ----------------------------------------------------------------------------

_ZCLIP_DIV = 1e-6  # zclip's fixed guard in T / (g + 1e-6)


def _observation(feedback: str, g: float, boundary: float, target: float, fired: bool) -> float:
    """What a judge-first clip-then-observe step teaches the statistics:
    ``min(g, B)`` under "clipped", the clip target on a (high-side) fire
    under "clip_target", the norm otherwise ("raw"; "skip" observes nothing)."""
    if feedback == "clipped":
        return min(g, boundary)
    if feedback == "clip_target" and fired:
        return target
    return g


def zclip(
    norms: Sequence[float],
    *,
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    feedback: str = "clip_target",
) -> dict[str, np.ndarray]:
    """zclip; ``threshold`` is the boundary ``min(B, cap)``, ``clip_to`` the norm it leaves with."""
    cap = INF if max_grad_norm is None else float(max_grad_norm)
    log = _Log([*COMMON, "clip_to", "mean", "std", "z", *(["capped"] if cap < INF else [])])
    samples: list[float] = []
    mean = var = NAN

    def stats() -> dict[str, float]:
        if math.isnan(mean):
            return {"mean": NAN, "std": NAN}
        return {"mean": mean, "std": math.sqrt(var)}

    for g in map(float, norms):
        if not math.isfinite(g):
            log.add(
                g=g,
                threshold=NAN,
                scale=1.0,
                observed=False,
                z=NAN,
                clip_to=g,
                capped=False,
                **stats(),
            )
            continue
        if log.count < warmup_steps:
            samples.append(g)
            if len(samples) == warmup_steps:
                mean, var = float(np.mean(samples)), float(np.var(samples))
            scale = min(1.0, cap / (g + _ZCLIP_DIV))
            to = min(g, cap) if scale < 1 else g
            capped = _capped(g, 1.0, cap)[1]
            log.add(
                g=g,
                threshold=cap,
                scale=scale,
                observed=True,
                z=0.0,
                clip_to=to,
                capped=capped,
                **stats(),
            )
            continue
        std = math.sqrt(var)
        z = (g - mean) / (std + eps)
        if mode == "percentile":
            boundary = mean + z_thresh * std
            clip_val = boundary
            spike = g > boundary
        else:
            boundary = mean + z_thresh * (std + eps)
            spike = z > z_thresh
            if clip_option == "mean":
                clip_val = mean
            else:
                clip_val = clip_factor * (mean + z_thresh**2 * std / z) if spike else NAN
        applied = min(clip_val if spike else g, cap)
        scale = applied / (g + _ZCLIP_DIV) if g > applied else 1.0
        observed = not (spike and feedback == "skip")
        if observed:
            v = _observation(feedback, g, boundary, clip_val, spike)
            new_mean = alpha * mean + (1 - alpha) * v
            var = alpha * var + (1 - alpha) * (v - new_mean) ** 2
            mean = new_mean
        to = applied if scale < 1 else g
        threshold = min(boundary, cap)
        # The ceiling is the bound where it lies at or below the rule's clip value.
        capped = _capped(g, clip_val / (g + _ZCLIP_DIV) if spike else 1.0, cap)[1]
        log.add(
            g=g,
            threshold=threshold,
            scale=scale,
            observed=observed,
            z=z,
            clip_to=to,
            capped=capped,
            **stats(),
        )
    return log.out()


# ----------------------------------------------------------------------------
# hist_clip, with warmup_clip=None
# ----------------------------------------------------------------------------

_CLIP_FNS: dict[str, Callable[[float, float], float]] = {
    "max": lambda s, t: t,
    "reciprocal": lambda s, t: t * t / s,
    "mean": lambda s, t: 0.0,
}


def hist_clip(
    norms: Sequence[float],
    *,
    criterion: str = "zstat",
    alpha: float | None = None,
    thresh: float | None = None,
    clip: str | None = None,
    warmup_steps: int = 20,
    feedback: str = "raw",
    max_grad_norm: Any = "auto",
) -> dict[str, np.ndarray]:
    """hist_clip with ``warmup_clip=None`` (warm-up steps pass unchanged, but for
    the ceiling ``max_grad_norm``, which bounds every step)."""
    cap = _ceiling(max_grad_norm, feedback)
    zstat = criterion == "zstat"
    alpha = (0.97 if zstat else 0.98) if alpha is None else alpha
    thresh = (2.5 if zstat else 1.05) if thresh is None else thresh
    clip = ("reciprocal" if zstat else "max") if clip is None else clip
    f = _CLIP_FNS[clip]
    fields = ["clip_to", "mean", "std", "z"] if zstat else ["clip_to", "mean"]
    log = _Log(COMMON + fields + (["capped"] if cap < INF else []))
    samples: list[float] = []
    mu, v = 0.0, 1.0
    started = False

    def stats() -> dict[str, float]:
        return {"mean": mu, "std": math.sqrt(v)} if zstat else {"mean": mu}

    for g in map(float, norms):
        if not math.isfinite(g):
            log.add(
                g=g,
                threshold=NAN,
                scale=1.0,
                observed=False,
                z=NAN,
                clip_to=g,
                capped=False,
                **stats(),
            )
            continue
        if log.count < warmup_steps:
            samples.append(g)
            # The statistics reported on the step that completes the warm-up set are
            # not defined by the rule (drytorch still shows its initial 0 / 1.0 there,
            # clipjax may show them initialised): not compared.
            last = len(samples) == warmup_steps
            shown = {k: NAN for k in stats()} if last else stats()
            scale, capped = _capped(g, 1.0, cap)
            log.add(
                g=g,
                threshold=min(INF, cap),
                scale=scale,
                observed=True,
                z=0.0,
                clip_to=cap if capped else g,
                capped=capped,
                **shown,
            )
            continue
        if not started:
            started = True
            if samples:
                mu = float(np.mean(samples))
            if len(samples) > 1 and np.var(samples, ddof=1) > 0:
                v = float(np.var(samples, ddof=1))
        active = mu != 0
        if zstat:
            sd = math.sqrt(v)
            stat = abs((g - mu) / (sd + 1e-8))
            fires = active and stat > thresh
            clip_val = mu + f(stat, thresh) * sd if fires else NAN
        else:
            stat = g / mu if active else NAN
            fires = active and stat > thresh
            factor = 1.0 if clip == "mean" else (f(stat, thresh) if fires else NAN)
            clip_val = mu * factor
        if not active:
            boundary = INF
        elif zstat:
            boundary = mu + thresh * (math.sqrt(v) + 1e-8)
        else:
            boundary = mu * thresh
        scale = min(1.0, clip_val / (g + 1e-6)) if fires else 1.0
        high = fires and g > mu
        observed = not (high and feedback == "skip")
        if observed:
            x = _observation(feedback, g, boundary, clip_val, high)
            if zstat:
                v = alpha * v + (1 - alpha) * (x - mu) ** 2
            mu = alpha * mu + (1 - alpha) * x
        extra = {"z": stat} if zstat else {}
        to = clip_val if (high and scale < 1) else g
        scale, capped = _capped(g, scale, cap)
        log.add(
            g=g,
            threshold=min(boundary, cap),
            scale=scale,
            observed=observed,
            clip_to=cap if capped else to,
            capped=capped,
            **extra,
            **stats(),
        )
    return log.out()


# ----------------------------------------------------------------------------
# adagc
# ----------------------------------------------------------------------------


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
                log.add(g=g, threshold=NAN, scale=1.0, observed=False, mean=gamma[i])
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
                gamma[i] = beta * gamma[i] + (1 - beta) * obs
            log.add(g=g, threshold=threshold, scale=scale, observed=observed, mean=gamma[i])
    outs = [log.out() for log in logs]
    return {k: np.stack([o[k] for o in outs], axis=1) for k in outs[0]}


# ----------------------------------------------------------------------------
# Running clipjax on trees of given group norms, reading clipjax.metrics()
# ----------------------------------------------------------------------------

UNIT = np.array([0.5, -0.5, 0.5, -0.5])


def flat_tree(row: jax.Array) -> dict[str, jax.Array]:
    """One leaf per column: ``{"g0": row[0] * u, ...}`` (per_param groups g0, g1, ...)."""
    unit = jnp.asarray(UNIT, jnp.float32)
    return {f"g{i}": row[i] * unit for i in range(row.shape[0])}


def layer_tree(row: jax.Array) -> dict[str, Any]:
    """Layers ``l0, l1, ...`` with a kernel and a bias whose joint norm is ``row[i]``.

    kernel = 0.6 row[i] u, bias = 0.8 row[i] u[:2]*sqrt(2) (norms 0.6 and 0.8 of it).
    """
    unit = jnp.asarray(UNIT, jnp.float32)
    bias_unit = jnp.asarray([math.sqrt(0.5), -math.sqrt(0.5)], jnp.float32)
    return {
        f"l{i}": {"kernel": 0.6 * row[i] * unit, "bias": 0.8 * row[i] * bias_unit}
        for i in range(row.shape[0])
    }


def group_norms(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.linalg.norm(a.astype(jnp.float32)), tree)


def run_tree(
    tx: Any, norms: np.ndarray, make_tree: Callable[[jax.Array], Any] = flat_tree
) -> tuple[dict[str, np.ndarray], Any, Any]:
    """Runs ``tx`` (any optax transform) over ``[steps, k]`` norms in one jitted scan.

    Returns ``(metrics, outputs, inputs)``: ``clipjax.metrics`` per step (arrays
    ``[steps]``) and the per-leaf norms of the transform's output and input
    (trees of ``[steps]`` arrays), plus per-leaf "output identical to input".
    """
    seq = jnp.asarray(np.asarray(norms, np.float64), jnp.float32)
    params = make_tree(jnp.ones(seq.shape[1], jnp.float32))
    state0 = tx.init(params)

    def step(state: Any, row: jax.Array) -> Any:
        grads = make_tree(row)
        out, state = tx.update(grads, state, params)
        same = jax.tree.map(lambda a, b: jnp.array_equal(a, b, equal_nan=True), out, grads)
        return state, (clipjax.metrics(state), group_norms(out), group_norms(grads), same)

    metrics, outs, ins, same = jax.jit(lambda s: jax.lax.scan(step, state0, s)[1])(seq)
    m = {k: np.asarray(v) for k, v in metrics.items()}
    return m, (jax.tree.map(np.asarray, outs), jax.tree.map(np.asarray, ins)), same


def compare(
    got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
    prefix: str,
    fields: Sequence[str] | None = None,
    rtol: float = RTOL,
    atol: float = 1e-6,
    atol_for: dict[str, float] | None = None,
) -> None:
    """``got[prefix + field]`` vs ``want[field]`` for every field the restatement defines.

    Positions where the restatement has NaN (undefined by the rule) are not
    compared; elsewhere the finite/infinite pattern must match and finite values
    agree to ``rtol`` (``atol`` only for values near 0, e.g. a std of ~0).
    Integer/boolean fields must match exactly. ``atol_for`` overrides ``atol``
    per field; by default ``z`` gets ``Z_ATOL``.
    """
    atol_for = {"z": Z_ATOL, **(atol_for or {})}
    fields = list(want) if fields is None else list(fields)
    for f in fields:
        key = prefix + f
        assert key in got, f"{key} missing from metrics: {sorted(got)[:20]}..."
        g = np.asarray(got[key], np.float64)
        w = np.asarray(want[f], np.float64)
        assert g.shape == w.shape, (key, g.shape, w.shape)
        defined = ~np.isnan(w)
        if f in ("count", "step", "clipped_count", "nonfinite_count", "clipped", "capped"):
            bad = np.nonzero(g[defined] != w[defined])[0]
            assert bad.size == 0, (
                f"{key}: first mismatch at {np.nonzero(defined)[0][bad[:5]]}: "
                f"got {g[defined][bad[:5]]}, want {w[defined][bad[:5]]}"
            )
            continue
        gd, wd = g[defined], w[defined]
        np.testing.assert_array_equal(np.isfinite(gd), np.isfinite(wd), err_msg=key)
        fin = np.isfinite(wd)
        np.testing.assert_array_equal(gd[~fin], wd[~fin], err_msg=key)
        tol = atol_for.get(f, atol)
        np.testing.assert_allclose(gd[fin], wd[fin], rtol=rtol, atol=tol, err_msg=key)

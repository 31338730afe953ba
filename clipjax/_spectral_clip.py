"""spectral_clip: each layer gradient's singular values clamped at a threshold.

Restates katcinskiy/spectral-clipping's ``clipping.py`` (arXiv 2605.11838):
``SpectralClipperConst``, ``SpectralClipperEMA`` and ``SpectralClipperQuantile``
choose a threshold ``tau`` per parameter (a constant; the bias-corrected EMA of
the parameter's past top singular values; a quantile of the last
``window_size`` of them) and replace the gradient ``G = U S V^T`` by
``U min(S, tau) V^T``. The ``feedback`` and ``factor`` that the EMA and quantile
rules add, and the deviations from the reference, are in docs/defences.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipjax import _checks, _grouping, _kit, _stats, _xla
from clipjax._metrics import GroupInfo
from clipjax._spectra import MatricesFn, matrix_plan

Array = jax.Array
ALGO = "spectral_clip"
RULES = ("constant", "ema", "quantile")
FEEDBACK = {"constant": ("raw",), "ema": ("raw", "clipped", "skip"), "quantile": ("raw", "clipped")}
METHODS = ("svd", "lowrank")
APPLY_TO = ("2d", "all")
# The Gaussian test matrices of method="lowrank" come from this key and the step.
LOWRANK_SEED = 0


class SpectralClipState(NamedTuple):
    """State of :func:`spectral_clip`: one group per matrix (a vector is an ``[n, 1]`` matrix).

    Attributes:
      ema: ``[groups]`` EMA of the observed top singular values, not bias
        corrected (``rule="ema"``; else None).
      window: the last ``window_size`` observed top singular values, with a
        sorted copy (``rule="quantile"``; else None).
      metrics: ``[groups]`` arrays: ``grad_norm`` (the matrix's Frobenius
        norm), ``sigma_max`` (its top singular value), ``threshold`` (this
        step's ``tau``), ``scale`` (the clipped matrix's Frobenius norm over
        the matrix's), ``clipped``, the rule's statistic after this step
        (``mean``, the bias-corrected EMA, or ``quantile``) and the counters.
      info: static names; the groups are the leaf names, ``name[i]`` for the
        ``i``-th matrix of a leaf with batch axes (stacked layers).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.spectral_clip(rule="ema").init({"w": jnp.zeros((4, 3))})
      >>> state.info.groups, state.ema.shape
      (('w',), (1,))
    """

    ema: Array | None
    window: _stats.WindowState | None
    metrics: dict[str, Array]
    info: GroupInfo


class _Leaf(NamedTuple):
    """How a leaf becomes ``[n, rows, cols]`` matrices, or None (left as it is)."""

    order: tuple[int, ...]
    rows: int
    cols: int
    count: int
    names: tuple[str, ...]


def quantile_indices(quantile: float, window_size: int) -> np.ndarray:
    """``int(quantile * (n - 1))`` for ``n = 0 .. window_size``: the reference's index
    into the sorted history of ``n`` values, in Python floats as it computes it."""
    return np.asarray([int(quantile * (n - 1)) if n else 0 for n in range(window_size + 1)])


def _svd(
    x: Array, rank: int | None, iterations: int, key: Array | None
) -> tuple[Array, Array, Array]:
    """``(U, S, Vh)`` of ``[n, rows, cols]``: exact, or the top ``rank`` by a randomized
    range finder (Halko et al.; ``torch.svd_lowrank``'s algorithm) with ``iterations``
    power iterations and ``rank + 5`` columns."""
    if rank is None:
        u, s, vh = jnp.linalg.svd(x, full_matrices=False)
        return u, s, vh
    assert key is not None
    rows, cols = x.shape[-2:]
    k = min(rank, rows, cols)
    q = min(k + 5, rows, cols)
    xt = jnp.swapaxes(x, -1, -2)
    probe = jax.random.normal(key, (x.shape[0], cols, q), x.dtype)
    basis = jnp.linalg.qr(x @ probe)[0]
    for _ in range(iterations):
        basis = jnp.linalg.qr(x @ jnp.linalg.qr(xt @ basis)[0])[0]
    u, s, vh = jnp.linalg.svd(jnp.swapaxes(basis, -1, -2) @ x, full_matrices=False)
    return (basis @ u)[..., :k], s[..., :k], vh[..., :k, :]


def spectral_clip(
    threshold: float | Array | None = None,
    *,
    rule: str = "constant",
    ema_coef: float | Array = 0.9,
    quantile: float | None = None,
    window_size: int | None = None,
    factor: float | Array | None = None,
    feedback: str = "raw",
    apply_to: str = "all",
    matrices: MatricesFn | None = None,
    rank: int | None = None,
    power_iterations: int | None = None,
    name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Spectral gradient clipping: clamps each matrix's singular values at ``tau``.

    Each matrix gradient ``G = U S V^T`` becomes ``U min(S, tau) V^T``: the
    directions whose singular values exceed ``tau`` are shortened to ``tau``,
    the others pass exactly. A vector is the ``[n, 1]`` matrix of the
    reference (its one singular value is its norm: a norm clip at ``tau``).
    ``tau`` is, per matrix:

    * ``rule="constant"``: ``threshold``;
    * ``rule="ema"``: ``factor`` times the bias-corrected EMA (``ema_coef``) of
      the matrix's past top singular values (none at its first step);
    * ``rule="quantile"``: ``factor`` times the ``quantile`` of the last
      ``window_size`` of them (the reference's ``sorted(h)[int(q (n - 1))]``).

    ``feedback`` says what a step teaches the EMA or the window: ``"raw"``
    (the reference) the top singular value; ``"clipped"`` (EMA) the value
    capped at this step's ``tau``, so a spike moves the EMA no more than a step
    at ``tau`` would, and a lasting rise is learnt at ``(1 - ema_coef)
    (factor - 1)`` a step (``factor`` must exceed 1, else the EMA can only
    fall); ``"skip"`` (EMA) nothing where the step was clipped (a lasting rise
    can then hold it at the old level). A quantile is a rank statistic: under
    ``"clipped"`` it observes the value itself, as autoclip's percentile mode
    does. A matrix with a non-finite element passes unchanged and is not observed.

    Chain it before the optimizer, as a norm clip: ``optax.chain(
    clipjax.spectral_clip(rule="ema"), optax.adamw(lr))``; with data
    parallelism, on the averaged gradient.

    Static arguments: ``quantile``, ``window_size``, ``rank`` and
    ``power_iterations`` (an index table, buffer sizes, the SVD's shapes);
    ``threshold``, ``ema_coef`` and ``factor`` may be injected.

    Args:
      threshold: ``tau`` of ``rule="constant"`` (> 0); not taken by the others.
      rule: ``"constant"``, ``"ema"`` or ``"quantile"``.
      ema_coef: the EMA's coefficient, in (0, 1); default 0.9 (the reference's).
      quantile: in [0, 1]; default 0.85 (the reference's).
      window_size: the quantile's history (``>= 1``); default 100 (the reference's).
      factor: ``tau`` over the statistic (> 0); default 1 (the reference),
        1.5 for ``rule="ema"`` with ``feedback="clipped"`` or ``"skip"``.
      feedback: ``"raw"``, ``"clipped"`` or ``"skip"`` (above).
      apply_to: ``"all"`` (the reference: vectors too) or ``"2d"`` (vectors
        and scalars pass unchanged). Scalars always pass.
      matrices: ``(leaf name, shape) -> (fan_in_axes, fan_out_axes)`` or None
        (leave the leaf as it is), asked of every leaf of 2+ dimensions, as
        :func:`clipjax.spectra` asks it; default: a 2-D leaf is one matrix,
        3+ dimensions are refused; ``(fan_in_axes, ())`` reads one vector
        per index of the other axes (stacked layer norms ``[layers, d]``:
        ``((-1,), ())``). The reference leaves its embeddings (by
        name); ``lambda name, shape: None if "embed" in name else (0, 1)``
        does the same for a flax model's 2-D leaves.
      rank: clamp the top ``rank`` singular values of a randomized low-rank
        SVD (the reference's ``method="randomized_svd"``); default None, an
        exact SVD.
      power_iterations: of the randomized SVD (``>= 0``); default 1.
      name: metrics prefix (default ``spectral_clip``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`SpectralClipState`, read with
      ``clipjax.metrics(state)["spectral_clip/w/sigma_max"]``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, clipjax
      >>> tx = clipjax.spectral_clip(1.0)
      >>> g = {"w": jnp.diag(jnp.array([0.5, 3.0]))}
      >>> out, state = tx.update(g, tx.init(g))
      >>> np.round(np.diag(out["w"]), 4)
      array([0.5, 1. ], dtype=float32)
      >>> float(clipjax.metrics(state)["spectral_clip/w/sigma_max"])
      3.0

    References:
      Spectral gradient clipping, arXiv 2605.11838; katcinskiy/spectral-clipping,
      ``clipping.py``.
    """
    _checks.choice("rule", rule, RULES)
    _checks.feedback(feedback, FEEDBACK[rule])
    _checks.choice("apply_to", apply_to, APPLY_TO)
    _checks.name(name)
    if rule == "constant":
        if threshold is None:
            raise ValueError('rule="constant" needs threshold= (the clamp on singular values)')
        _checks.positive("threshold", threshold)
    elif threshold is not None:
        raise ValueError(f"threshold is rule='constant''s; rule={rule!r} chooses its own")
    _checks.open_unit("ema_coef", ema_coef)
    if quantile is not None:
        _checks.static_number("quantile", quantile)
        _checks.check("quantile", quantile, lambda x: 0 <= x <= 1, "in [0, 1]")
    quantile = 0.85 if quantile is None else float(quantile)
    window_size = 100 if window_size is None else window_size
    _checks.integer("window_size", window_size, 1)
    if factor is None:
        factor = 1.5 if rule == "ema" and feedback != "raw" else 1.0
    _checks.positive("factor", factor)
    factor_value = _checks.concrete(factor)
    if rule == "ema" and feedback == "clipped" and factor_value is not None and factor_value <= 1:
        raise ValueError(
            f"factor must exceed 1 with feedback='clipped' (got {factor!r}): the EMA then "
            "observes at most factor x itself, and at factor <= 1 it can never rise"
        )
    if rank is not None:
        _checks.integer("rank", rank, 1)
    power_iterations = 1 if power_iterations is None else power_iterations
    _checks.integer("power_iterations", power_iterations, 0)
    if matrices is not None and not callable(matrices):
        raise ValueError(
            f"matrices must be a callable (name, shape) -> axes or None, got {matrices!r}"
        )
    who = name or ALGO
    indices = jnp.asarray(quantile_indices(quantile, window_size), jnp.int32)

    def plan_of(leaf: Any, path: Any) -> _Leaf | None:
        leaf_name = _grouping.path_name(path)
        shape = tuple(np.shape(leaf))
        if len(shape) == 0 or math.prod(shape) == 0 or (len(shape) == 1 and apply_to == "2d"):
            return None
        if len(shape) == 1:
            return _Leaf((0,), shape[0], 1, 1, (leaf_name,))
        plan = matrix_plan(leaf_name, shape, matrices, who=who, vectors=True)
        if plan is None:
            return None
        batch, fan_in, fan_out = plan
        count = math.prod(shape[a] for a in batch)
        names = (leaf_name,) if not batch else tuple(f"{leaf_name}[{i}]" for i in range(count))
        return _Leaf(
            batch + fan_in + fan_out,
            math.prod(shape[a] for a in fan_in),
            math.prod(shape[a] for a in fan_out),
            count,
            names,
        )

    def plans(tree: Any) -> list[_Leaf | None]:
        leaves, paths, _ = _grouping.leaves_with_names(tree)
        return [plan_of(leaf, path) for leaf, path in zip(leaves, paths)]

    def init_fn(params: Any) -> SpectralClipState:
        placeholder = _kit.is_placeholder(params)
        groups = () if placeholder else sum((p.names for p in plans(params) if p), ())
        leaves, _, _ = _grouping.leaves_with_names(params)
        dtype = _grouping.norm_dtype(leaves)
        n = len(groups)
        info = _kit.group_info(params, "per_param", ALGO, name)
        info_class = type(info)
        statistic = {"ema": ("mean",), "quantile": ("quantile",)}.get(rule, ())
        return SpectralClipState(
            ema=jnp.zeros((n,), dtype) if rule == "ema" else None,
            window=_stats.window_init(n, window_size, dtype) if rule == "quantile" else None,
            metrics=_kit.new_metrics(
                n,
                dtype,
                ("grad_norm", "sigma_max", "threshold", "scale", "clipped", *statistic),
            ),
            info=info_class(ALGO, name, groups, info.leaves, info.shapes),
        )

    def update_fn(
        updates: Any, state: SpectralClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, SpectralClipState]:
        del params, extra_args
        _checks.check_state(state, SpectralClipState, who)
        grouping = _grouping.make_grouping(updates, "per_param")
        grouping.check_matches(state.info.leaves, state.info.shapes, who)
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        _grouping.check_inexact(leaves, grouping, who)
        dtype = _grouping.norm_dtype(leaves)
        if not state.info.groups:
            return updates, state
        key = (
            None
            if rank is None
            else jax.random.fold_in(jax.random.PRNGKey(LOWRANK_SEED), state.metrics["step"][0])
        )

        # Every matrix as [n, rows, cols] over its largest magnitude, so that finite
        # entries give finite singular values; its SVD.
        work = []
        for i, (leaf, plan) in enumerate(zip(leaves, plans(updates))):
            if plan is None:
                continue
            x = jnp.transpose(leaf, plan.order).reshape(plan.count, plan.rows, plan.cols)
            x = x.astype(jnp.result_type(leaf.dtype, dtype))  # complex stays complex
            big = jnp.max(jnp.abs(x), axis=(-2, -1))
            finite = jnp.isfinite(big)
            m = jnp.where(finite & (big > 0), big, 1.0)
            xs = jnp.where(finite[:, None, None], x / m[:, None, None], 0.0)
            if work:  # one decomposition at a time (clipjax._xla.after says why)
                xs = _xla.after(xs, work[-1][7])
            u, s, vh = _svd(
                xs, rank, power_iterations, None if key is None else jax.random.fold_in(key, i)
            )
            work.append((i, plan, x, xs, m, finite, u, s, vh))
        sigma = jnp.concatenate([jnp.where(f, s[:, 0] * m, jnp.nan) for *_, m, f, _, s, _ in work])
        finite = jnp.concatenate([f for *_, f, _, _, _ in work])
        seen = state.metrics["count"]
        if rule == "constant":
            tau = jnp.broadcast_to(jnp.asarray(threshold, dtype), sigma.shape)
        elif rule == "ema":
            assert state.ema is not None
            coef = jnp.asarray(ema_coef, dtype)
            debias = 1.0 - coef ** seen.astype(dtype)
            mean = state.ema / jnp.where(seen > 0, debias, 1.0)
            tau = jnp.where(seen > 0, jnp.asarray(factor, dtype) * mean, sigma)
        else:
            assert state.window is not None
            n = jnp.minimum(seen, window_size)
            at = jnp.take_along_axis(state.window.sorted, indices[n][:, None], axis=1)[:, 0]
            tau = jnp.where(n > 0, jnp.asarray(factor, dtype) * at, sigma)
        fires = finite & (sigma > tau)

        # A clipped matrix is U min(S, tau) V^T, as the reference builds it (of a
        # randomized SVD, U (min(S, tau) - S) V^T added to it, as the reference
        # does); the others pass exactly.
        new_leaves = list(leaves)
        norms, kept = [], []
        start = 0
        for i, plan, x, xs, m, f, u, s, vh in work:
            stop = start + plan.count
            t, fire = tau[start:stop], fires[start:stop]
            bound = jnp.minimum(s, (t / m)[:, None])
            scale = m[:, None, None].astype(x.dtype)
            if rank is None:
                out = scale * ((u * bound[:, None, :].astype(u.dtype)) @ vh)
            else:
                out = x + scale * ((u * (bound - s)[:, None, :].astype(u.dtype)) @ vh)
            out = jnp.where(fire[:, None, None], out, x)
            norm = m * jnp.sqrt(jnp.sum(jnp.square(jnp.abs(xs)), axis=(-2, -1)))
            after = m * jnp.sqrt(
                jnp.sum(jnp.square(jnp.abs(out / m[:, None, None])), axis=(-2, -1))
            )
            norms.append(jnp.where(f, norm, jnp.nan))
            kept.append(jnp.where(fire & (norm > 0), after / jnp.where(norm > 0, norm, 1.0), 1.0))
            leaf = leaves[i]
            shape = tuple(leaf.shape[a] for a in plan.order)
            out = out.astype(leaf.dtype).reshape(shape)
            new_leaves[i] = jnp.transpose(out, [int(a) for a in np.argsort(plan.order)])
            start = stop

        mode = "raw" if rule == "quantile" else feedback
        value, observed = _kit.observation(mode, sigma, boundary=tau, fires=fires)
        fields: dict[str, Array] = {}
        ema, window = state.ema, state.window
        if ema is not None:
            coef = jnp.asarray(ema_coef, dtype)
            ema = jnp.where(observed, coef * ema + (1.0 - coef) * value, ema)
            count = seen + observed.astype(seen.dtype)
            fields["mean"] = jnp.where(count > 0, ema / (1.0 - coef ** count.astype(dtype)), 0.0)
        if window is not None:
            window = _kit.select_groups(observed, _stats.window_update(window, value), window)
            n = jnp.minimum(window.count, window_size)
            at = jnp.take_along_axis(window.sorted, indices[n][:, None], axis=1)[:, 0]
            fields["quantile"] = jnp.where(n > 0, at, 0.0)
        metrics = _kit.step_metrics(
            state.metrics,
            norm=jnp.concatenate(norms),
            observed=observed,
            finite=finite,
            sigma_max=sigma,
            threshold=tau,
            scale=jnp.concatenate(kept),
            clipped=fires,
            **fields,
        )
        new_state = SpectralClipState(ema=ema, window=window, metrics=metrics, info=state.info)
        return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]

"""spectra: SPECTRA's soft spectral clip of each weight matrix's update.

After the base optimizer, every matrix update ``U`` has its singular values
mapped ``sigma -> sigma / sqrt(1 + sigma**2 / c**2)``: computed, without an
SVD, as ``(I + U U^T / c**2)^(-1/2) U`` by a coupled Newton-Schulz iteration,
then scaled by Muon's ``sqrt(max(1, fan_out / fan_in))``. Restates
mlolab/llm-spectral-clipping's ``src/optim/post_process.py`` (``clip_sigvals``,
``matrix_inv_sqrt_NS``) and ``src/optim/spectra.py`` (the wrapper, its
warm-up coupling of ``c`` to the learning rate); the deviations are listed in
docs/defences_2025.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipjax import _checks, _grouping, _kit
from clipjax._metrics import GroupInfo

Array = jax.Array
ALGO = "spectra"
APPLY_TO = ("2d", "all")
# Which axes of a leaf are a matrix's fan-in and fan-out (an axis or a tuple of axes,
# flattened in order); the leaf's other axes are batch axes, one matrix per index.
Axes = tuple[int | tuple[int, ...], int | tuple[int, ...]]
MatricesFn = Callable[[str, tuple[int, ...]], Axes | None]
# The paper's guard on the warm-up's division by the learning rate.
MIN_LEARNING_RATE = 1e-10


class SpectraState(NamedTuple):
    """State of :func:`spectra`.

    Attributes:
      count: ``int32`` steps taken (the warm-up's clock).
      metrics: ``[1]``-shaped arrays (group ``global``): ``grad_norm`` (the
        global L2 norm of the updates before the clip), ``threshold`` (this
        step's ``c``), ``sigma_bound`` (the largest upper bound on a matrix's
        top singular value, or a vector's norm, before the clip),
        ``clipped`` (a bound above ``c``), ``clipped_fraction`` (of the
        matrices and vectors, those whose bound is above ``c``) and the
        counters ``step``, ``clipped_count``, ``nonfinite_count``.
      info: static names, ``GroupInfo(algo="spectra", ...)``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.spectra(1.0).init({"w": jnp.zeros((4, 3))})
      >>> int(state.count), state.info.groups
      (0, ('global',))
    """

    count: Array
    metrics: dict[str, Array]
    info: GroupInfo


def inverse_sqrt_newton_schulz(a_hat: Array, iterations: int) -> Array:
    """``a_hat ** (-1/2)`` for symmetric ``[..., m, m]`` with eigenvalues in ``(0, 1]``.

    The coupled iteration of ``_matrix_inv_sqrt_NS_core``: ``Y = a_hat``,
    ``Z = I``, then ``T = (3 I - Z Y) / 2``, ``Y <- Y T``, ``Z <- T Z``;
    ``Y -> a_hat^(1/2)`` and ``Z -> a_hat^(-1/2)``, in ``a_hat``'s dtype.
    """
    eye = jnp.eye(a_hat.shape[-1], dtype=a_hat.dtype)
    three = jnp.asarray(3.0, a_hat.dtype)
    half = jnp.asarray(0.5, a_hat.dtype)

    # Unrolled, as torch.compile unrolls the paper's loop: XLA's cost analysis then
    # counts every step (it counts a loop's body once).
    y, z = a_hat, jnp.broadcast_to(eye, a_hat.shape)
    for _ in range(iterations):
        t = half * (three * eye - z @ y)
        y, z = y @ t, t @ z
    return z


def soft_clip_matrices(x: Array, c: Any, iterations: int, dtype: Any) -> tuple[Array, Array]:
    """``(clipped, bound)``: each ``[..., rows, cols]`` matrix's singular values
    soft-clipped at ``c``, and the upper bound on its top singular value.

    ``clip_sigvals``: in ``dtype``, the wide side (rows <= cols) is clipped,
    ``(I + X X^T / c**2)^(-1/2) X`` with the inverse square root scaled by
    ``alpha = 1 + s / c**2``, ``s`` the smaller of the Gershgorin bound (the
    largest absolute row sum) and the Frobenius norm of ``X X^T``. ``s`` is
    taken per matrix (the paper's code takes the largest over a batch).
    """
    c = jnp.asarray(c, jnp.float32)
    work = x.astype(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    gram = work @ jnp.swapaxes(work, -1, -2)
    gershgorin = jnp.max(jnp.sum(jnp.abs(gram), axis=-1), axis=-1)
    frobenius = jnp.sqrt(jnp.sum(jnp.square(gram.astype(jnp.float32)), axis=(-2, -1)))
    top = jnp.minimum(gershgorin.astype(jnp.float32), frobenius)
    inv_c2 = 1.0 / (c * c)
    eye = jnp.eye(gram.shape[-1], dtype=dtype)
    alpha = (1.0 + top * inv_c2).astype(dtype)[..., None, None]
    a = eye + (gram.astype(jnp.float32) * inv_c2).astype(dtype)
    z = inverse_sqrt_newton_schulz(a / alpha, iterations) / jnp.sqrt(alpha)
    out = z @ work
    if tall:
        out = jnp.swapaxes(out, -1, -2)
    return out.astype(x.dtype), jnp.sqrt(top)


def soft_clip_vector(x: Array, c: Any) -> tuple[Array, Array]:
    """``(clipped, norm)``: ``clip_sigvals``'s vector rule, ``x`` unchanged while
    ``||x|| <= c``, else ``x / sqrt(1 + (||x|| / c)**2)``."""
    c = jnp.asarray(c, jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(jnp.abs(x).astype(jnp.float32))))
    factor = jnp.where(norm <= c, 1.0, jax.lax.rsqrt(1.0 + jnp.square(norm / c)))
    return (x * factor.astype(x.dtype)), norm


def _axes_tuple(axes: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(a % ndim for a in ((axes,) if isinstance(axes, int) else axes))


def matrix_plan(
    leaf_name: str, shape: tuple[int, ...], matrices: MatricesFn | None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``(batch, fan_in, fan_out)`` axes of a leaf of 2+ dimensions, or None (left as it is).

    Default (``matrices=None``): a 2-D leaf is ``[fan_in, fan_out]`` (flax's and
    optax's kernel layout); a leaf of 3+ dimensions is refused.
    """
    ndim = len(shape)
    if matrices is None:
        if ndim == 2:
            return (), (0,), (1,)
        raise ValueError(
            f"spectra: leaf {leaf_name!r} of shape {shape} is neither a vector nor a matrix; "
            "say which axes are its matrices' fan-in and fan-out with matrices=(a callable "
            "(name, shape) -> (fan_in_axes, fan_out_axes), or None to leave it), e.g. "
            "lambda name, shape: (-2, -1) for stacked layers [layers, in, out]"
        )
    axes = matrices(leaf_name, shape)
    if axes is None:
        return None
    if not (isinstance(axes, tuple) and len(axes) == 2):
        raise ValueError(
            f"spectra: matrices({leaf_name!r}, {shape}) must return (fan_in_axes, "
            f"fan_out_axes) or None, got {axes!r}"
        )
    try:
        fan_in, fan_out = (_axes_tuple(a, ndim) for a in axes)
    except TypeError:
        raise ValueError(
            f"spectra: matrices({leaf_name!r}, {shape}) gave {axes!r}: each of fan_in_axes "
            "and fan_out_axes must be an int or a tuple of ints"
        ) from None
    named = fan_in + fan_out
    if not fan_in or not fan_out or len(set(named)) != len(named):
        raise ValueError(
            f"spectra: matrices({leaf_name!r}, {shape}) gave {axes!r}: fan-in and fan-out "
            "must each name at least one axis, and no axis twice"
        )
    batch = tuple(a for a in range(ndim) if a not in named)
    return batch, fan_in, fan_out


def _clip_leaf(
    leaf: Array, plan: Any, c: Any, iterations: int, dtype: Any
) -> tuple[Array, Array, Array]:
    """``(clipped leaf, bounds, above c)`` of one matrix leaf, by its ``plan``."""
    batch, fan_in, fan_out = plan
    shape = leaf.shape
    rows = math.prod(shape[a] for a in fan_in)
    cols = math.prod(shape[a] for a in fan_out)
    order = batch + fan_in + fan_out
    batch_shape = tuple(shape[a] for a in batch)
    x = jnp.transpose(leaf, order).reshape((*batch_shape, rows, cols))
    out, bound = soft_clip_matrices(x, c, iterations, dtype)
    # Muon's factor on torch's [out, in] weights: sqrt(max(1, rows / cols)) there.
    out = out * jnp.asarray(math.sqrt(max(1.0, cols / rows)), out.dtype)
    out = out.reshape(tuple(shape[a] for a in order))
    out = jnp.transpose(out, [int(a) for a in np.argsort(order)])
    bound = bound.reshape(-1)
    return out, bound, bound > jnp.asarray(c, jnp.float32)


def spectra(
    c: float | Array,
    *,
    iterations: int | None = None,
    dtype: Any = None,
    apply_to: str = "2d",
    matrices: MatricesFn | None = None,
    learning_rate: Callable[[Any], Any] | None = None,
    warmup_steps: int | None = None,
    name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """SPECTRA: soft-clips the singular values of each weight matrix's update at ``c``.

    Chained after the base optimizer's direction (before the learning rate),
    each matrix ``U`` of the updates becomes ``sqrt(max(1, fan_out / fan_in))
    * (I + U U^T / c**2)^(-1/2) U``: its singular values ``sigma -> sigma /
    sqrt(1 + sigma**2 / c**2)`` (about ``sigma`` below ``c``, below ``c`` always)
    by ``iterations`` coupled Newton-Schulz steps in ``dtype`` (no SVD), then
    Muon's shape factor. With ``apply_to="all"`` every vector (and scalar)
    leaf ``u`` whose norm exceeds ``c`` becomes ``u / sqrt(1 + (||u|| / c)**2)``;
    with ``"2d"`` (the paper's default) they pass unchanged. During a
    learning-rate warm-up, ``c * learning_rate`` is held at its value at the
    end of the warm-up (step ``count < warmup_steps`` clips at ``c *
    learning_rate(warmup_steps) / learning_rate(count)``).

    The paper's AdamW + SPECTRA is ``optax.chain(optax.scale_by_adam(b1, b2,
    eps), clipjax.spectra(c), optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(schedule))``: the weight decay is not clipped.

    Static arguments: ``iterations``, ``warmup_steps`` and ``dtype`` (a loop
    bound, a schedule's bound, the iteration's arithmetic); ``c`` may be
    injected.

    Args:
      c: the clip level of the singular values (> 0).
      iterations: Newton-Schulz steps (``>= 1``); default 10 (the paper's).
      dtype: the iteration's dtype; default ``jnp.bfloat16`` (the paper's
        default; ``jnp.float32`` its ``use_float32=True``).
      apply_to: ``"2d"`` (matrices only) or ``"all"`` (vectors too).
      matrices: ``(leaf name, shape) -> (fan_in_axes, fan_out_axes)`` or None
        (leave the leaf as it is), asked of every leaf of 2+ dimensions; each
        is an axis or a tuple of axes (flattened), the other axes are batch
        axes (a matrix each). Default: a 2-D leaf is ``[fan_in, fan_out]``
        and a leaf of 3+ dimensions is refused. ``lambda name, shape: (-2,
        -1)`` reads stacked layers ``[layers, in, out]``; ``(0, 1, 2), 3`` a
        conv kernel ``[h, w, in, out]`` as Muon's flattened matrix.
      learning_rate: the schedule the warm-up coupling reads (``count -> lr``);
        needed with ``warmup_steps``.
      warmup_steps: steps of the learning-rate warm-up (``>= 0``); default 0.
      name: metrics prefix (default ``spectra``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`SpectraState`, read with
      ``clipjax.metrics(state)["spectra/global/sigma_bound"]``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, optax, clipjax
      >>> tx = clipjax.spectra(1.0, dtype=jnp.float32)
      >>> u = {"w": jnp.diag(jnp.array([0.1, 3.0]))}
      >>> out, state = tx.update(u, tx.init(u))
      >>> np.round(np.diag(out["w"]), 3)  # 0.1 / sqrt(1.01), 3 / sqrt(10)
      array([0.1  , 0.949], dtype=float32)
      >>> bool(clipjax.metrics(state)["spectra/global/clipped"])
      True

    References:
      SPECTRA, spectral clipping of the update (ICML 2026);
      mlolab/llm-spectral-clipping, ``src/optim/spectra.py`` and
      ``src/optim/post_process.py``.
    """
    iterations = 10 if iterations is None else iterations
    warmup_steps = 0 if warmup_steps is None else warmup_steps
    dtype = jnp.bfloat16 if dtype is None else dtype
    _checks.positive("c", c)
    _checks.integer("iterations", iterations, 1)
    _checks.integer("warmup_steps", warmup_steps, 0)
    _checks.choice("apply_to", apply_to, APPLY_TO)
    _checks.name(name)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
    if matrices is not None and not callable(matrices):
        raise ValueError(
            f"matrices must be a callable (name, shape) -> axes or None, got {matrices!r}"
        )
    if learning_rate is not None and not callable(learning_rate):
        raise ValueError(f"learning_rate must be a schedule (count -> lr), got {learning_rate!r}")
    if warmup_steps > 0 and learning_rate is None:
        raise ValueError("warmup_steps needs learning_rate= (the schedule c * lr is held along)")
    who = name or ALGO

    def plans(tree: Any) -> list[Any]:
        leaves, paths, _ = _grouping.leaves_with_names(tree)
        out = []
        for leaf, path in zip(leaves, paths):
            shape = tuple(np.shape(leaf))
            if len(shape) >= 2:
                plan = matrix_plan(_grouping.path_name(path), shape, matrices)
                if plan is not None and jnp.iscomplexobj(leaf):
                    raise ValueError(
                        f"spectra: leaf {_grouping.path_name(path)!r} is a complex matrix; "
                        "the Newton-Schulz iteration is real (leave it with matrices=)"
                    )
                # A matrix with no entries has nothing to clip.
                out.append(None if math.prod(shape) == 0 else plan)
            else:
                out.append("vector" if apply_to == "all" else None)
        return out

    def init_fn(params: Any) -> SpectraState:
        if not _kit.is_placeholder(params):
            plans(params)  # refuses an unreadable leaf now, not at the first step
        return SpectraState(
            count=jnp.zeros((), jnp.int32),
            metrics=_kit.new_metrics(
                1,
                jnp.float32,
                ("grad_norm", "threshold", "sigma_bound", "clipped", "clipped_fraction"),
                ("step", "clipped_count", "nonfinite_count"),
                grad_norm=jnp.nan,
                threshold=jnp.nan,
                sigma_bound=jnp.nan,
            ),
            info=_kit.group_info(params, "global", ALGO, name),
        )

    def update_fn(
        updates: Any, state: SpectraState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, SpectraState]:
        del params, extra_args
        _checks.check_state(state, SpectraState, who)
        grouping = _grouping.make_grouping(updates, "global")
        grouping.check_matches(state.info.leaves, state.info.shapes, who)
        threshold = jnp.asarray(c, jnp.float32)
        if warmup_steps > 0:
            assert learning_rate is not None
            peak = jnp.asarray(learning_rate(warmup_steps), jnp.float32)
            now = jnp.maximum(
                jnp.asarray(learning_rate(state.count), jnp.float32), MIN_LEARNING_RATE
            )
            threshold = jnp.where(state.count < warmup_steps, threshold * peak / now, threshold)

        leaves, _, treedef = _grouping.leaves_with_names(updates)
        new_leaves, bounds, above = [], [], []
        for leaf, plan in zip(leaves, plans(updates)):
            if plan is None:
                new_leaves.append(leaf)
                continue
            if plan == "vector":
                out, norm = soft_clip_vector(leaf, threshold)
                bound, over = norm.reshape(1), (norm > threshold).reshape(1)
            else:
                out, bound, over = _clip_leaf(leaf, plan, threshold, iterations, dtype)
            new_leaves.append(out)
            bounds.append(bound)
            above.append(over)

        squares = [jnp.sum(jnp.square(jnp.abs(leaf).astype(jnp.float32))) for leaf in leaves]
        norm = jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))
        if bounds:
            bound = jnp.concatenate(bounds)
            over = jnp.concatenate(above)
            sigma_bound = jnp.max(bound)
            clipped_fraction = jnp.mean(over.astype(jnp.float32))
        else:
            sigma_bound = jnp.asarray(jnp.nan, jnp.float32)
            clipped_fraction = jnp.zeros((), jnp.float32)
        metrics = _kit.step_metrics(
            state.metrics,
            norm=norm.reshape(1),
            threshold=threshold.reshape(1),
            clipped=(clipped_fraction > 0).reshape(1),
            sigma_bound=sigma_bound.reshape(1),
            clipped_fraction=clipped_fraction.reshape(1),
        )
        new_state = SpectraState(count=state.count + 1, metrics=metrics, info=state.info)
        return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]

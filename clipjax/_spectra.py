"""spectra: SPECTRA's soft spectral clip of each weight matrix's update.

After the base optimizer, every matrix update ``U`` has its singular values
mapped ``sigma -> sigma / sqrt(1 + sigma**2 / c**2)``: computed, without an
SVD, as ``(I + U U^T / c**2)^(-1/2) U`` by a coupled Newton-Schulz iteration,
then scaled by Muon's ``sqrt(max(1, fan_out / fan_in))``. Restates
mlolab/llm-spectral-clipping's ``src/optim/post_process.py`` (``clip_sigvals``,
``matrix_inv_sqrt_NS``, and ``normalize_sigvals``, the ``"normalize"``
post-process) and ``src/optim/spectra.py`` (the wrapper; ``_get_current_clip_c``,
its warm-up coupling of ``c`` to the learning rate and its decay schedules of
``c``); the deviations are listed in docs/defences.md.
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
POST_PROCESS = ("clip", "normalize")
# The decay schedules of c after the warm-up (the reference's clip_decay_type).
DECAYS = ("constant", "linear", "sqrt", "cosine", "exp", "square")
# Muon's quintic Newton-Schulz coefficients (normalize_sigvals) and its norm guard.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NORMALIZE_EPS = 1e-7
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
        step's ``c``; 1 under ``post_process="normalize"``, the level it sets
        singular values to), ``sigma_bound`` (the largest upper bound on a
        matrix's top singular value, or a vector's norm, before the clip),
        ``clipped`` (a bound above ``threshold``), ``clipped_fraction`` (of the
        matrices and vectors, those whose bound is above ``threshold``) and the
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
    top = _gram_bound(gram)
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


def _gram_bound(gram: Array) -> Array:
    """The smaller of the Gershgorin bound and the Frobenius norm of ``[..., m, m]``
    ``gram``: an upper bound on its top eigenvalue, in float32."""
    gershgorin = jnp.max(jnp.sum(jnp.abs(gram), axis=-1), axis=-1)
    frobenius = jnp.sqrt(jnp.sum(jnp.square(gram.astype(jnp.float32)), axis=(-2, -1)))
    return jnp.minimum(gershgorin.astype(jnp.float32), frobenius)


def normalize_matrices(x: Array, iterations: int, dtype: Any) -> tuple[Array, Array]:
    """``(normalized, bound)``: each ``[..., rows, cols]`` matrix's singular values
    set to about 1 by Muon's quintic Newton-Schulz iteration, and the upper bound
    on its top singular value.

    ``normalize_sigvals``: in ``dtype``, on the wide side, ``X`` divided by its
    Frobenius norm plus ``1e-7``, then ``iterations`` steps of ``A = X X^T``,
    ``X <- a X + (b A + c A A) X`` with ``(a, b, c) = (3.4445, -4.7750,
    2.0315)``: each singular value ``s`` of the scaled matrix goes through
    ``p(s) = a s + b s**3 + c s**5`` that many times (into about [0.7, 1.2]),
    the singular vectors kept. ``bound`` is :func:`soft_clip_matrices`'
    Gershgorin/Frobenius bound, read off the first step's ``A``.
    """
    work = x.astype(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(work.astype(jnp.float32)), axis=(-2, -1)))
    scale = norm + NORMALIZE_EPS
    work = (work.astype(jnp.float32) / scale[..., None, None]).astype(dtype)
    a, b, c = (jnp.asarray(k, dtype) for k in MUON_COEFFICIENTS)
    bound = jnp.zeros(norm.shape, jnp.float32)
    # Unrolled, as torch.compile unrolls the paper's loop (see inverse_sqrt_newton_schulz).
    for step in range(iterations):
        gram = work @ jnp.swapaxes(work, -1, -2)
        if step == 0:
            bound = jnp.sqrt(_gram_bound(gram)) * scale
        work = a * work + (b * gram + c * (gram @ gram)) @ work
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    return work.astype(x.dtype), bound


def normalize_vector(x: Array) -> tuple[Array, Array]:
    """``(normalized, norm)``: ``normalize_sigvals``'s vector rule, ``x / (||x|| + 1e-7)``."""
    norm = jnp.sqrt(jnp.sum(jnp.square(jnp.abs(x).astype(jnp.float32))))
    return x * (1.0 / (norm + NORMALIZE_EPS)).astype(x.dtype), norm


def decay_factor(count: Array, decay: str, fraction: float, final: float, total: int) -> Array:
    """The factor on ``c`` at step ``count`` (after the warm-up): ``_get_current_clip_c``'s
    decay phase.

    The last ``int(fraction * total)`` steps of ``total`` (``n``, Python's
    truncation) decay ``c``; before them the factor is 1. At step ``count`` in
    them, with ``progress = min((count - (total - n)) / max(n, 1), 1)``, the
    factor goes from 1 to ``final``: ``final + (1 - final) * w`` with ``w`` =
    ``1 - progress`` (linear), ``1 - sqrt(progress)`` (sqrt), ``(1 +
    cos(pi * progress)) / 2`` (cosine), ``1 - progress**2`` (square); ``exp`` is
    ``final**progress`` (``1 - progress`` where ``final`` is 0).
    """
    anneal = int(fraction * total)
    hold = total - anneal
    steps = (count - hold).astype(jnp.float32)
    progress = jnp.clip(steps / float(max(anneal, 1)), 0.0, 1.0)
    if decay == "exp":
        factor = jnp.power(final, progress) if final > 0 else 1.0 - progress
    else:
        weight = {
            "linear": lambda: 1.0 - progress,
            "sqrt": lambda: 1.0 - jnp.sqrt(progress),
            "cosine": lambda: (1.0 + jnp.cos(jnp.pi * progress)) * 0.5,
            "square": lambda: 1.0 - jnp.square(progress),
        }[decay]()
        factor = final + (1.0 - final) * weight
    # Exactly 1 while held (final + (1 - final) may round off 1 in float32).
    return jnp.where(count < hold, 1.0, factor)


def _axes_tuple(axes: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(a % ndim for a in ((axes,) if isinstance(axes, int) else axes))


def matrix_plan(
    leaf_name: str,
    shape: tuple[int, ...],
    matrices: MatricesFn | None,
    who: str = ALGO,
    vectors: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``(batch, fan_in, fan_out)`` axes of a leaf of 2+ dimensions, or None (left as it is).

    Default (``matrices=None``): a 2-D leaf is ``[fan_in, fan_out]`` (flax's and
    optax's kernel layout); a leaf of 3+ dimensions is refused. With ``vectors``,
    ``(fan_in_axes, ())`` reads one vector (an ``[n, 1]`` matrix) per index of the
    other axes. Errors name ``who``.
    """
    ndim = len(shape)
    if matrices is None:
        if ndim == 2:
            return (), (0,), (1,)
        raise ValueError(
            f"{who}: leaf {leaf_name!r} of shape {shape} is neither a vector nor a matrix; "
            "say which axes are its matrices' fan-in and fan-out with matrices=(a callable "
            "(name, shape) -> (fan_in_axes, fan_out_axes), or None to leave it), e.g. "
            "lambda name, shape: (-2, -1) for stacked layers [layers, in, out]"
        )
    axes = matrices(leaf_name, shape)
    if axes is None:
        return None
    if not (isinstance(axes, tuple) and len(axes) == 2):
        raise ValueError(
            f"{who}: matrices({leaf_name!r}, {shape}) must return (fan_in_axes, "
            f"fan_out_axes) or None, got {axes!r}"
        )
    vector = vectors and axes[1] == ()
    try:
        fan_in = _axes_tuple(axes[0], ndim)
        fan_out = () if vector else _axes_tuple(axes[1], ndim)
    except TypeError:
        raise ValueError(
            f"{who}: matrices({leaf_name!r}, {shape}) gave {axes!r}: each of fan_in_axes "
            "and fan_out_axes must be an int or a tuple of ints"
        ) from None
    named = fan_in + fan_out
    if not fan_in or not (fan_out or vector) or len(set(named)) != len(named):
        raise ValueError(
            f"{who}: matrices({leaf_name!r}, {shape}) gave {axes!r}: fan-in and fan-out "
            "must each name at least one axis, and no axis twice"
        )
    batch = tuple(a for a in range(ndim) if a not in named)
    return batch, fan_in, fan_out


def _clip_leaf(
    leaf: Array, plan: Any, c: Any, iterations: int, dtype: Any, normalize: bool = False
) -> tuple[Array, Array, Array]:
    """``(clipped leaf, bounds, above c)`` of one matrix leaf, by its ``plan``
    (``normalize``: singular values set to about 1, ``c`` the level compared)."""
    batch, fan_in, fan_out = plan
    shape = leaf.shape
    rows = math.prod(shape[a] for a in fan_in)
    cols = math.prod(shape[a] for a in fan_out)
    order = batch + fan_in + fan_out
    batch_shape = tuple(shape[a] for a in batch)
    x = jnp.transpose(leaf, order).reshape((*batch_shape, rows, cols))
    if normalize:
        out, bound = normalize_matrices(x, iterations, dtype)
    else:
        out, bound = soft_clip_matrices(x, c, iterations, dtype)
    # Muon's factor on torch's [out, in] weights: sqrt(max(1, rows / cols)) there.
    out = out * jnp.asarray(math.sqrt(max(1.0, cols / rows)), out.dtype)
    out = out.reshape(tuple(shape[a] for a in order))
    out = jnp.transpose(out, [int(a) for a in np.argsort(order)])
    bound = bound.reshape(-1)
    return out, bound, bound > jnp.asarray(c, jnp.float32)


def spectra(
    c: float | Array | None,
    *,
    iterations: int | None = None,
    dtype: Any = None,
    apply_to: str = "2d",
    matrices: MatricesFn | None = None,
    learning_rate: Callable[[Any], Any] | None = None,
    warmup_steps: int | None = None,
    decay: str = "constant",
    decay_fraction: float | None = None,
    final_scale: float | None = None,
    total_steps: int | None = None,
    post_process: str = "clip",
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
    learning_rate(warmup_steps) / learning_rate(count)``). After it, ``c``
    stays as it is (``decay="constant"``) or, in the last ``int(decay_fraction
    * total_steps)`` steps, decays to ``c * final_scale`` by ``decay``'s
    schedule (the warm-up takes precedence where the two meet).
    ``post_process="normalize"`` sets each matrix's singular values to about
    1 instead (Muon's quintic iteration, ``c`` not read), and divides a vector
    by its norm under ``"all"``.

    The paper's AdamW + SPECTRA is ``optax.chain(optax.scale_by_adam(b1, b2,
    eps), clipjax.spectra(c), optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(schedule))``: the weight decay is not clipped.

    Static arguments: ``iterations``, ``warmup_steps``, ``decay_fraction``,
    ``final_scale``, ``total_steps`` and ``dtype`` (a loop bound, a schedule's
    bounds and shape, the iteration's arithmetic); ``c`` may be injected.

    Args:
      c: the clip level of the singular values (> 0); not read (None allowed)
        under ``post_process="normalize"``.
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
      decay: the schedule of ``c`` after the warm-up (the paper's
        ``clip_decay_type``): ``"constant"`` (the default: ``c`` throughout),
        ``"linear"``, ``"sqrt"``, ``"cosine"``, ``"square"`` (``c * (final +
        (1 - final) * w)`` with ``w`` = ``1 - p``, ``1 - sqrt(p)``, ``(1 +
        cos(pi p)) / 2``, ``1 - p**2`` of the decay's progress ``p`` from 0
        to 1) or ``"exp"`` (``c * final**p``; ``c * (1 - p)`` where ``final``
        is 0). Needs ``total_steps``.
      decay_fraction: the fraction of ``total_steps`` that decays, in ``[0,
        1]``: the last ``int(decay_fraction * total_steps)`` steps (``p`` is
        their step over their number, reaching 1 at ``total_steps``); default
        0.1 (the paper's ``clip_decay_fract``).
      final_scale: ``c``'s factor at the end of the decay (``>= 0``); default 0
        (the paper's ``clip_final_scale``). At ``c = 0`` (from
        ``total_steps`` on) the rule's limit, a zero update, is given.
      total_steps: the training's length in steps (``>= 1``), which the decay
        ends at; needed with ``decay``.
      post_process: ``"clip"`` (the default: the soft clip at ``c``) or
        ``"normalize"`` (the paper's alternative, ``normalize_sigvals``: each
        matrix divided by its Frobenius norm, then ``iterations`` steps of
        Muon's quintic Newton-Schulz iteration, which leave its singular
        values in about [0.7, 1.2] and its singular vectors as they were;
        then Muon's shape factor; under ``apply_to="all"`` a vector ``u``
        becomes ``u / (||u|| + 1e-7)``). No warm-up or decay with it.
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
    _checks.choice("post_process", post_process, POST_PROCESS)
    normalize = post_process == "normalize"
    if not (normalize and c is None):
        _checks.positive("c", c)
    _checks.integer("iterations", iterations, 1)
    _checks.integer("warmup_steps", warmup_steps, 0)
    _checks.choice("apply_to", apply_to, APPLY_TO)
    _checks.choice("decay", decay, DECAYS)
    shaping = dict(decay_fraction=decay_fraction, final_scale=final_scale, total_steps=total_steps)
    if decay == "constant":
        given = [k for k, v in shaping.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} shape a decay of c; pass decay= (one of {DECAYS[1:]}) "
                "or leave them out"
            )
    else:
        if total_steps is None:
            raise ValueError(f"decay={decay!r} needs total_steps= (the decay ends there)")
        _checks.integer("total_steps", total_steps, 1)
    decay_fraction = 0.1 if decay_fraction is None else decay_fraction
    final_scale = 0.0 if final_scale is None else final_scale
    total_steps = 0 if total_steps is None else total_steps
    _checks.static_number("decay_fraction", decay_fraction)
    _checks.check("decay_fraction", decay_fraction, lambda x: 0 <= x <= 1, "in [0, 1]")
    _checks.static_number("final_scale", final_scale)
    _checks.check("final_scale", final_scale, lambda x: 0 <= x < math.inf, ">= 0 and finite")
    decay_fraction, final_scale = float(decay_fraction), float(final_scale)
    if normalize and (warmup_steps > 0 or decay != "constant"):
        raise ValueError(
            "post_process='normalize' has no c to schedule: leave out warmup_steps and decay"
        )
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
        threshold = jnp.asarray(1.0 if normalize else c, jnp.float32)
        if decay != "constant":
            threshold = threshold * decay_factor(
                state.count, decay, decay_fraction, final_scale, total_steps
            )
        if warmup_steps > 0:
            assert learning_rate is not None
            peak = jnp.asarray(learning_rate(warmup_steps), jnp.float32)
            now = jnp.maximum(
                jnp.asarray(learning_rate(state.count), jnp.float32), MIN_LEARNING_RATE
            )
            held = jnp.asarray(c, jnp.float32) * peak / now
            threshold = jnp.where(state.count < warmup_steps, held, threshold)
        # A decay to final_scale=0 reaches c = 0, where the rule's limit is a zero
        # update: the clip runs at a stand-in c and its output is replaced.
        live = threshold > 0 if decay != "constant" else None
        level = threshold if live is None else jnp.where(live, threshold, 1.0)

        leaves, _, treedef = _grouping.leaves_with_names(updates)
        new_leaves, bounds, above = [], [], []
        for leaf, plan in zip(leaves, plans(updates)):
            if plan is None:
                new_leaves.append(leaf)
                continue
            if plan == "vector":
                if normalize:
                    out, norm = normalize_vector(leaf)
                else:
                    out, norm = soft_clip_vector(leaf, level)
                bound, over = norm.reshape(1), (norm > threshold).reshape(1)
            else:
                out, bound, over = _clip_leaf(leaf, plan, level, iterations, dtype, normalize)
                over = over if live is None else bound > threshold
            if live is not None:
                out = jnp.where(live, out, jnp.zeros_like(out))
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

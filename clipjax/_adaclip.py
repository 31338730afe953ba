"""Stable-SPAM's AdaClip and AdaGN, for any optimizer (:func:`clipjax.stable_spam` chains them)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _checks, _grouping, _kit, _xla
from clipjax._grouping import Scope
from clipjax._metrics import GroupInfo

Array = jax.Array


class AdaClipState(NamedTuple):
    """State of :func:`adaclip`: its EMA per group.

    Attributes:
      max_ema: ``[groups]`` the EMA of each group's largest ``|g|`` (uncorrected).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.adaclip().init({"w": jnp.zeros(2), "b": jnp.zeros(1)})
      >>> isinstance(state, clipjax.AdaClipState), state.info.groups
      (True, ('b', 'w'))
    """

    max_ema: Array
    metrics: dict[str, Array]
    info: GroupInfo
    leaf_index: tuple[Array, ...] = ()


class AdaNormState(NamedTuple):
    """State of :func:`ada_norm`: its EMAs per group.

    Attributes:
      norm_ema: ``[groups]`` the EMA of each group's L2 norm (not bias corrected).
      square_ema: ``[groups]`` the EMA of its square (not bias corrected).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.ada_norm(scope="global").init({"w": jnp.zeros(2)})
      >>> isinstance(state, clipjax.AdaNormState), state.info.groups
      (True, ('global',))
    """

    norm_ema: Array
    square_ema: Array
    metrics: dict[str, Array]
    info: GroupInfo
    leaf_index: tuple[Array, ...] = ()


def _max_and_square(x: Array, dtype: Any) -> tuple[Array, Array]:
    """A leaf's largest finite ``|x|`` and its sum of squares (NaN or inf where an element is)."""
    squared = _grouping.abs_squared(x, dtype)
    magnitude = jnp.sqrt(squared) if jnp.iscomplexobj(x) else jnp.abs(x.astype(dtype))
    # A non-finite element counts as 0 for the max: the others are bounded
    # as in the step without it.
    magnitude = jnp.where(jnp.isfinite(magnitude), magnitude, jnp.zeros((), dtype))
    largest, square = jax.lax.reduce(
        (magnitude.reshape(-1), squared.reshape(-1)),
        (jnp.zeros((), dtype), jnp.zeros((), dtype)),
        lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]),
        (0,),
    )
    return largest, square


def _max_and_squares(leaves: list[Array], dtype: Any) -> tuple[list[Array], list[Array]]:
    """Each leaf's largest ``|x|`` and its sum of squares, in one reduce per leaf."""
    one = _xla.per_leaf(_max_and_square, dtype)
    pairs = [one(x) for x in leaves]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _finite_square_and_count(
    x: Array, dtype: Any, keep_axis: int | None = None
) -> tuple[Array, ...]:
    """A leaf's sum of squares over its finite elements, and how many are not."""
    squared = _grouping.abs_squared(x, dtype)
    ok = jnp.isfinite(squared)
    terms = (jnp.where(ok, squared, jnp.zeros((), dtype)), jnp.where(ok, 0.0, 1.0).astype(dtype))
    if keep_axis is None:
        return _xla.fused_sums(*terms)
    axes = tuple(a for a in range(jnp.ndim(x)) if a != keep_axis)
    return tuple(jnp.sum(t, axis=axes) for t in terms)


def _adaclip_leaf(
    x: Array, b: Array, r: Array, dtype: Any, count_clipped: bool
) -> tuple[Array, Array | None, Array | None]:
    """A leaf scaled by ``r`` where ``|x| > b`` (and the counts with ``count_clipped``)."""
    # Not abs(x) > bound: XLA would share that abs with the max's and write it out.
    if jnp.iscomplexobj(x):
        hit = _grouping.abs_squared(x, dtype) > b**2
    else:
        xb = x.astype(dtype)
        hit = (xb > b) | (xb < -b)
    new = jnp.where(hit, x * r.astype(x.dtype), x)
    if not count_clipped:
        return new, None, None
    # A second pass: the bound needs this step's max. Two sums in one reduce: a
    # lone sum has XLA:CPU write its input out. The squares are taken here (not
    # in the max's reduce) and used, so that XLA keeps this reduce variadic.
    ones = jnp.where(hit, 1.0, 0.0).astype(dtype)
    hit_count, square = _xla.fused_sums(ones, _grouping.abs_squared(x, dtype))
    return new, hit_count, square


def adaclip(
    theta: Any = 0.999,
    *,
    scope: Scope = "per_param",
    count_clipped: bool = True,
    name: str | None = None,
) -> _kit.ClipTransform:
    """Stable-SPAM's AdaClip: bounds each element by an EMA of the largest one.

    Per group (a tensor with the default ``scope="per_param"``, as the
    reference), each step with the largest element ``M = max |g|``:

    1. ``max_ema = theta * max_ema + (1 - theta) * M`` (this step's ``M``
       included) and ``bound = max_ema / (1 - theta**k)`` after ``k`` steps;
    2. every element with ``|g| > bound`` is scaled by ``bound / M``: the
       largest becomes ``bound``, the others shrink in proportion (not a clamp).

    A NaN or infinite element counts as 0 for the maximum and passes
    unchanged. Differences from the reference: :doc:`/reference_spam`. A
    callable ``scope`` goes in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      theta: the EMA's decay rate, in (0, 1) (the paper's gamma_3).
      scope: the groups (:class:`~clipjax.ClipTransform`); ``"per_param"``: the reference's.
      count_clipped: report ``clipped_fraction`` (a second read of the gradient).
      name: metrics prefix (default ``adaclip``).

    Returns:
      A :class:`clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.adaclip(0.9)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for spike in [1.0, 1.0, 1.0, 10.0]:
      ...     out, state = tx.update({"w": jnp.array([spike, 0.5])}, state)
      >>> [round(x, 3) for x in out["w"].tolist()]
      [3.617, 0.5]

    References:
      Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit
      Adam <https://arxiv.org/abs/2502.17055>`_, 2025; pytorch-optimizer
      ``StableSPAM`` (``pytorch_optimizer/optimizer/spam.py``).
    """
    _checks.open_unit("theta", theta)
    setup = _kit.setup("adaclip", scope=scope, name=name)
    fields = ("grad_norm", "grad_max", "bound", "clipped")
    fields += ("clipped_fraction",) * count_clipped

    def init_fn(params: Any) -> AdaClipState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        max_ema = jnp.zeros((n,), dtype)
        metrics = _kit.new_metrics(n, dtype, fields)
        return _kit.owned(params, AdaClipState(max_ema, metrics, common.info, common.leaf_index))

    def update_fn(updates: Any, state: AdaClipState, params: Any = None, **extra_args: Any) -> Any:
        del params, extra_args
        grads = _kit.grads_of(setup, updates, state, AdaClipState, init_fn)
        leaves, grouping = grads.leaves, grads.grouping
        dtype = state.max_ema.dtype
        maxima, squares = _max_and_squares(leaves, dtype)
        grad_max = _grouping.group_norms(leaves, grouping, math.inf, maxima)
        # Every step is observed: the max is over the finite elements.
        finite = jnp.isfinite(_grouping.group_norms(leaves, grouping, 2.0, squares))
        decay = jnp.asarray(theta, dtype)
        count = state.metrics["count"] + 1
        max_ema = decay * state.max_ema + (1 - decay) * grad_max
        bound = max_ema / (1 - decay ** count.astype(dtype))
        clips = grad_max > bound
        ratio = jnp.where(clips, bound / jnp.where(clips, grad_max, 1), 1)
        # Each leaf reads its group's values at a runtime offset (the state's
        # leaf index): with constant offsets every leaf's fusion is distinct and
        # compiled anew. A clipped group's bound; +inf where nothing is clipped.
        limit = jnp.where(clips, bound, jnp.inf)
        limits = _grouping.leaf_scales(grouping, limit, state.leaf_index)
        ratios = _grouping.leaf_scales(grouping, ratio, state.leaf_index)
        one = _xla.per_leaf(_adaclip_leaf, dtype, count_clipped)
        new_leaves, hits = [], []
        for i, (x, b, r) in enumerate(zip(leaves, limits, ratios)):
            new, hit_count, square = one(x, b, r)
            new_leaves.append(new)
            if count_clipped:
                hits.append(hit_count)
                squares[i] = square
        grad_norm = _grouping.group_norms(leaves, grouping, 2.0, squares)
        extra = {}
        if count_clipped:
            sizes = [
                max(sum(math.prod(grouping.leaf_shapes[i]) for i in m), 1) for m in grouping.members
            ]
            above = _grouping.group_norms(leaves, grouping, 1.0, hits)
            extra["clipped_fraction"] = above / jnp.asarray(sizes, dtype)
        metrics = _kit.step_metrics(
            state.metrics, norm=grad_norm, observed=jnp.ones_like(finite), clipped=clips,
            finite=finite, grad_max=grad_max, bound=bound, **extra,
        )  # fmt: skip
        new_state = AdaClipState(max_ema, metrics, state.info, _kit.kept_index(state))
        return _kit.rebuilt(grads, new_leaves), new_state

    return _kit.ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def ada_norm(
    gamma1: Any = 0.7,
    gamma2: Any = 0.9,
    eps: Any = 1e-8,
    *,
    scope: Scope = "per_param",
    axis_name: str | None = None,
    name: str | None = None,
) -> _kit.ClipTransform:
    """Stable-SPAM's AdaGN: gives the gradient an adaptive norm from EMAs of its norm.

    Per group (a tensor with the default ``scope="per_param"``, as the
    reference), each step with the group's L2 norm ``n``:

    1. ``norm_ema = gamma1 * norm_ema + (1 - gamma1) * n`` and ``square_ema =
       gamma2 * square_ema + (1 - gamma2) * n**2``;
    2. ``mean = norm_ema / (1 - gamma1**k)``, ``mean_square = square_ema / (1 -
       gamma2**k)`` after ``k`` observed steps;
    3. the gradient is rescaled to the norm ``mean / (sqrt(mean_square) +
       eps)``: ``g * target_norm / n``.

    A group whose norm is 0 passes through and stays out of the EMAs; a NaN or
    infinite element counts as 0 for the norm and passes unchanged. Differences
    from the reference: :doc:`/reference_spam`. A callable ``scope`` goes in
    ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      gamma1: the norm EMA's decay rate, in (0, 1).
      gamma2: the squared norm EMA's decay rate, in (0, 1).
      eps: added to ``sqrt(mean_square)``.
      scope: the groups (:class:`~clipjax.ClipTransform`); ``"per_param"``: the reference's.
      axis_name: average the group norms over this mapped axis first.
      name: metrics prefix (default ``ada_norm``).

    Returns:
      A :class:`clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.ada_norm(scope="global")
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> out, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> [round(x, 3) for x in out["w"].tolist()]
      [0.6, 0.8]

    References:
      Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit
      Adam <https://arxiv.org/abs/2502.17055>`_, 2025; pytorch-optimizer
      ``StableSPAM`` (``pytorch_optimizer/optimizer/spam.py``).
    """
    _checks.open_unit("gamma1", gamma1)
    _checks.open_unit("gamma2", gamma2)
    _checks.non_negative("eps", eps)
    setup = _kit.setup("ada_norm", scope=scope, name=name, axis_name=axis_name)
    fields = ("grad_norm", "mean", "mean_square", "target_norm", "scale")
    counters = ("count", "step", "nonfinite_count")

    def init_fn(params: Any) -> AdaNormState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        metrics = _kit.new_metrics(n, dtype, fields, counters)
        zeros = jnp.zeros((n,), dtype)
        state = AdaNormState(zeros, zeros, metrics, common.info, common.leaf_index)
        return _kit.owned(params, state)

    def update_fn(updates: Any, state: AdaNormState, params: Any = None, **extra_args: Any) -> Any:
        del params, extra_args
        grads = _kit.grads_of(setup, updates, state, AdaNormState, init_fn)
        leaves, grouping = grads.leaves, grads.grouping
        dtype = state.norm_ema.dtype
        one = _xla.per_leaf(_finite_square_and_count, dtype)
        stacks = grouping.leaf_stacks or (None,) * len(leaves)
        sums = [
            one(x) if st is None else _finite_square_and_count(x, dtype, st[0])
            for x, st in zip(leaves, stacks)
        ]
        norm = _grouping.group_norms(leaves, grouping, 2.0, [s[0] for s in sums])
        bad = _grouping.group_norms(leaves, grouping, 1.0, [s[1] for s in sums])
        if axis_name is not None:
            norm, bad = jax.lax.pmean((norm, bad), axis_name)
        finite = bad == 0
        active = norm > 0
        g1, g2 = jnp.asarray(gamma1, dtype), jnp.asarray(gamma2, dtype)
        count = state.metrics["count"] + active.astype(jnp.int32)
        norm_ema = jnp.where(active, g1 * state.norm_ema + (1 - g1) * norm, state.norm_ema)
        square_ema = jnp.where(
            active, g2 * state.square_ema + (1 - g2) * norm * norm, state.square_ema
        )
        k = jnp.maximum(count, 1).astype(dtype)
        mean = norm_ema / (1 - g1**k)
        mean_square = square_ema / (1 - g2**k)
        target = mean / (jnp.sqrt(mean_square) + jnp.asarray(eps, dtype))
        scale = jnp.where(active, target / jnp.where(active, norm, 1), 1).astype(dtype)
        new_leaves = _grouping.apply_scales(leaves, grouping, scale, state.leaf_index)
        metrics = _kit.step_metrics(
            state.metrics, norm=norm, observed=active, finite=finite, mean=mean,
            mean_square=mean_square, target_norm=target, scale=scale,
        )  # fmt: skip
        new_state = AdaNormState(norm_ema, square_ema, metrics, state.info, _kit.kept_index(state))
        return _kit.rebuilt(grads, new_leaves), new_state

    return _kit.ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]

"""Running a transform on some steps only, with no full-size copy.

:func:`run_if` is the one way clipjax does it (``skip_on_spike``'s optimizer,
hist_clip's warm-up clip, a chain's members); each route's cost: docs/cost.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _kit, _metrics
from clipjax._kit import ClipTransform
from clipjax._metrics import IDLE_VALUES

Array = jax.Array


class SkippableTransform(optax.GradientTransformationExtraArgs):
    """An optax transform that can also skip a step: ``update_if``.

    An ``optax.GradientTransformationExtraArgs`` with ``update_if(pred,
    updates, state, params=None, **extra_args)``: where the scalar ``pred``
    is True, what ``update`` computes; where False, zero updates and the state
    as it was, bit for bit, chosen element-wise without a conditional.
    ``keep_state_if`` (or None) is the same without zeroing the updates.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.adam(0.1)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> updates, new = tx.update_if(False, {"w": jnp.array([jnp.nan, 1.0])}, state)
      >>> updates["w"].tolist(), int(new[0].count)
      ([0.0, 0.0], 0)
    """

    update_if: Callable[..., tuple[Any, Any]]
    keep_state_if: Callable[..., tuple[Any, Any]] | None

    def __new__(
        cls,
        init: Callable[..., Any],
        update: Callable[..., Any],
        update_if: Callable[..., tuple[Any, Any]],
        keep_state_if: Callable[..., tuple[Any, Any]] | None = None,
    ) -> SkippableTransform:
        tx = super().__new__(cls, init, update)
        tx.update_if, tx.keep_state_if = update_if, keep_state_if
        return tx

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self.init, self.update, self.update_if, self.keep_state_if)


def skippable_step(init: Callable[..., Any], step: Callable[..., Any]) -> SkippableTransform:
    """:func:`skippable` from one ``step(pred, updates, state, params)`` (``pred=None``: update)."""

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        return step(None, updates, state, params)

    def keep_state_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        del extra_args
        return step(jnp.asarray(pred, bool), updates, state, params)

    return skippable(init, update, keep_state_if=keep_state_if)


def skippable(
    init: Callable[..., Any],
    update: Callable[..., Any],
    *,
    keep_state_if: Callable[..., tuple[Any, Any]] | None = None,
    update_if: Callable[..., tuple[Any, Any]] | None = None,
) -> SkippableTransform:
    """A ``SkippableTransform`` from its ``update_if``, or from ``keep_state_if``."""
    if update_if is None:
        assert keep_state_if is not None
        update_if = _zeroing(keep_state_if)
    return SkippableTransform(init, update, update_if, keep_state_if)


def _zeroing(keep_state_if: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """``update_if`` from ``keep_state_if``: the same, with zero updates where ``pred`` is False."""

    def update_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        pred = jnp.asarray(pred, bool)
        out, new_state = keep_state_if(pred, updates, state, params, **extra_args)
        return zero_unless(pred, out), new_state

    return update_if


def zero_unless(pred: Array, tree: Any) -> Any:
    # zeros_like keeps a weakly typed leaf weak, so that the moments it feeds
    # promote as they do in optax's own update.
    return jax.tree.map(lambda x: jnp.where(pred, x, jnp.zeros_like(x)), tree)


Route = Literal["fold", "select", "cond"]


def route_of(tx: Any) -> Route:
    """How :func:`run_if` skips ``tx``: ``"fold"`` (a :class:`SkippableTransform`),
    ``"select"`` (a clipjax clipper) or ``"cond"`` (any other, wrappers included)."""
    if isinstance(tx, SkippableTransform):
        return "fold"
    if isinstance(tx, ClipTransform):
        return "select"
    return "cond"


def run_if(
    route: Route,
    pred: Array,
    tx: Any,
    updates: Any,
    state: Any,
    params: Any = None,
    **extra_args: Any,
) -> tuple[Any, Any]:
    """``tx.update`` on the steps where ``pred`` holds; elsewhere its state stays as it was.

    ``route`` is :func:`route_of` ``(tx)``. Where ``pred`` is False the
    returned updates are not ``tx``'s: the caller masks them.
    """
    if route == "fold":
        # Folded into its own arithmetic (clipjax.adam: _adam.adam_arithmetic).
        return tx.update_if(pred, updates, state, params, **extra_args)
    if route == "select":
        return run_and_select(pred, tx, updates, state, params, **extra_args)

    operands, in_tree = jax.tree.flatten((updates, state))

    def run(leaves: list[Any]) -> list[Any]:
        out = tx.update(*jax.tree.unflatten(in_tree, leaves), params, **extra_args)
        return jax.tree.leaves(out)

    out_types = jax.eval_shape(lambda u, s: tx.update(u, s, params, **extra_args), updates, state)
    out_tree = jax.tree.structure(out_types)
    # The branches must return the same types: the inner update's, which may
    # differ from its inputs' (optax.adam(mu_dtype=float32) on bfloat16
    # gradients returns float32 updates; bfloat16 params with float32
    # gradients give bfloat16 moments...). The pass-through branch casts its
    # operands to them, which is no operation (and no copy) where they agree.
    if out_tree != in_tree:
        raise ValueError(
            "a transform run on some steps only returns updates and a state of another "
            f"tree structure than it was given ({in_tree} in, {out_tree} out), so a step "
            "it does not run cannot pass its inputs through"
        )

    def pass_through(leaves: list[Any]) -> list[Any]:
        return [_cast_like(x, t) for x, t in zip(leaves, jax.tree.leaves(out_types))]

    out_leaves = jax.lax.cond(pred, run, pass_through, operands)
    return jax.tree.unflatten(out_tree, out_leaves)


def _cast_like(x: Any, like: jax.ShapeDtypeStruct) -> Any:
    return x if jnp.result_type(x) == like.dtype else jnp.asarray(x).astype(like.dtype)


def run_and_select(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[Any, Any]:
    """``tx.update`` on every step; its (small) new state only where ``pred`` holds."""
    out, new_state = tx.update(updates, state, params, **extra_args)
    return out, _kit.select_groups(pred, new_state, state)


def selecting(tx: optax.GradientTransformation) -> SkippableTransform:
    """A transform with a scalar state that runs every step, its state selected."""
    tx = optax.with_extra_args_support(tx)

    def keep_state_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        pred = jnp.asarray(pred, bool)
        return run_and_select(pred, tx, updates, state, params, **extra_args)

    return skippable(tx.init, tx.update, keep_state_if=keep_state_if)


def chain(*transforms: optax.GradientTransformation) -> SkippableTransform:
    """``optax.chain`` that can skip a step: see :class:`SkippableTransform`.

    ``init`` and ``update`` are ``optax.chain(*transforms)``'s, bit for bit.
    ``update_if(pred, ...)`` passes ``pred`` to each member: one with its own
    ``update_if`` (:func:`clipjax.adamw`) folds it in; a clipjax clipper has
    its small state selected; any other transform runs under ``lax.cond``.

    A clipper that holds a step (``zclip(start="hold")``, the warm-up steps
    of ``zclip(feedback="clipped")``) makes the chain run the members after
    it as ``update_if(False, ...)`` on that step: zero updates, their states
    untouched, so the optimizer's moments never see the start of the run.
    Hence ``clipjax.chain(clipjax.zclip(feedback="clipped"), clipjax.adamw(...))``.

    Args:
      *transforms: the transforms to apply in order.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.chain(clipjax.zclip(), clipjax.adamw(1e-3))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> optax_state = optax.chain(clipjax.zclip(), optax.adamw(1e-3)).init(params)
      >>> jax.tree.structure(state) == jax.tree.structure(optax_state)
      True
      >>> updates, state = tx.update_if(False, {"w": jnp.ones(3)}, state, params)
      >>> updates["w"].tolist()
      [0.0, 0.0, 0.0]
    """
    members = [optax.with_extra_args_support(t) for t in transforms]
    base = optax.chain(*members)
    # A state per member; each member checks its own.
    layout = (object,) * len(members)
    # How each member skips a step, from what it is (route_of).
    routes: list[Route] = [route_of(member) for member in members]

    def run(
        pred: Any, updates: Any, state: Any, params: Any, **extra_args: Any
    ) -> tuple[Any, Any, Any]:
        """The members in order under ``pred``, False after a clipper's held step."""
        _checks.check_members(state, layout, "clipjax.chain")
        new_state = []
        for member, route, member_state in zip(members, routes, state):
            if pred is None:
                updates, member_state = member.update(updates, member_state, params, **extra_args)
            elif isinstance(member, SkippableTransform) and member.keep_state_if is not None:
                # Zeroed once, after the last member.
                updates, member_state = member.keep_state_if(
                    pred, updates, member_state, params, **extra_args
                )
            else:
                updates, member_state = run_if(
                    route, pred, member, updates, member_state, params, **extra_args
                )
            held = _metrics.held(member_state)
            if held is not None:
                pred = ~held if pred is None else pred & ~held
            new_state.append(member_state)
        return updates, tuple(new_state), pred

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        updates, new_state, pred = run(None, updates, state, params, **extra_args)
        if pred is not None:
            updates = zero_unless(pred, updates)
        return updates, new_state

    def keep_state_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        pred = jnp.asarray(pred, bool)
        updates, new_state, held_pred = run(pred, updates, state, params, **extra_args)
        if held_pred is not pred:
            # update_if zeroes where its own pred is False; the held steps here.
            updates = zero_unless(held_pred, updates)
        return updates, new_state

    return skippable(base.init, update, keep_state_if=keep_state_if)


def idle_metrics(metrics: dict[str, Array]) -> dict[str, Array]:
    """The metrics of a step the transform did not run: ``IDLE_VALUES``, the rest kept."""
    return {
        key: jnp.full_like(value, IDLE_VALUES[key]) if key in IDLE_VALUES else value
        for key, value in metrics.items()
    }

"""Running a transform on some steps only, with no full-size copy.

:func:`run_if` is the one way clipjax runs a transform on the steps a
predicate selects: ``skip_on_spike``'s inner optimizer, hist_clip's warm-up
clip, the optimizers that fold a skip into their own arithmetic
(:mod:`clipjax._fold`). On a step a transform did not run, its clipjax state
reports :func:`idle_metrics`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from clipjax._kit import ClipTransform
from clipjax._metrics import IDLE_VALUES

Array = jax.Array


class FoldClaim:
    """A predicate handed to the :class:`clipjax.SkippableTransform` inside a wrapper.

    ``optax.inject_hyperparams(clipjax.adamw)`` or
    ``optax.MultiSteps(clipjax.adamw(...))`` has no ``update_if`` of its own,
    but it calls its inner optimizer's ``update``. While a claim is active
    (``with claim:``), a ``SkippableTransform``'s ``update`` runs its
    ``update_if(claim.pred, ...)`` instead, records that it did and which
    state leaves it returned (already selected), and the wrapper's own
    bookkeeping around it is then selected by :func:`run_if`.
    """

    def __init__(self, pred: Any) -> None:
        self.pred = pred
        self.claimed = False
        self.selected: list[Any] = []
        self.previous: Any = None

    def __enter__(self) -> FoldClaim:
        self.previous = getattr(_PENDING, "claim", None)
        _PENDING.claim = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _PENDING.claim = self.previous


_PENDING = threading.local()


def fold_or_update(
    update: Callable[..., Any], update_if: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """A ``SkippableTransform``'s ``update``: ``update_if`` under an active claim."""
    claim = getattr(_PENDING, "claim", None)
    if claim is None:
        return update(*args, **kwargs)
    claim.claimed = True
    _PENDING.claim = None  # the members inside fold through their own update_if
    try:
        out, new_state = update_if(claim.pred, *args, **kwargs)
    finally:
        _PENDING.claim = claim
    claim.selected.extend(jax.tree.leaves(new_state))
    return out, new_state


def run_if(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[Any, Any]:
    """``tx.update`` on the steps where ``pred`` holds; elsewhere its state stays as it was.

    The one way clipjax runs a transform on some steps only (skip_on_spike's
    inner optimizer, hist_clip's warm-up clip). Where ``pred`` is False the
    returned updates are not ``tx``'s: the caller masks them.

    Three routes, all free of full-size copies in the compiled step:

    * a transform with its own ``update_if`` (a
      :class:`clipjax.SkippableTransform`: :func:`clipjax.adam`,
      :func:`clipjax.adamw`, :func:`clipjax.chain`) folds ``pred`` into its
      arithmetic: each moment is selected element-wise in the loop that
      computes the update from it, and the updates come back zero where
      ``pred`` is False. No conditional: the whole step fuses with
      ``apply_updates`` and costs no pass over the updates beyond the
      optimizer's own;
    * a transform that calls a ``SkippableTransform``'s ``update`` inside it
      (``optax.inject_hyperparams(clipjax.adamw)(...)``,
      ``optax.MultiSteps(clipjax.adamw(...), k)``) runs every step under a
      :class:`FoldClaim`: the optimizer inside folds ``pred`` in, and the
      rest of the wrapper's state is selected. This is found by tracing its
      update once (the same trace then runs it);
    * a clipjax transform holds only small ``[groups]`` arrays: it runs on
      every step and its state is selected. Its norms are the ones the caller
      computes anyway (XLA merges the identical reductions) and its scaling
      fuses with the caller's, so it costs no extra pass over the gradients;
    * any other transform (an optimizer with full-size moments) runs under
      ``lax.cond`` whose pass-through branch is branch 0 (the false branch)
      and returns its operands as they are: XLA elides the buffer copies of
      such a branch only then. Skipping in branch 0, or returning fresh zeros,
      copies the optimizer state or the updates every step; computing the
      update unconditionally and selecting the moments afterwards copies them
      too, because the parameter update then recomputes the new moments from
      the old ones after they were overwritten in place. The conditional
      still writes the updates out and reads them back (it cannot fuse with
      ``apply_updates``): about two passes over the updates. The branches
      return the inner update's own output types (from the one trace of
      it, ``jax.make_jaxpr``, which the taken branch then runs): where
      it changes a dtype (``optax.adam(mu_dtype=jnp.float32)`` on bfloat16
      gradients returns float32 updates), the pass-through branch casts its
      operands to them; where the dtypes agree it casts nothing and stays
      copy-free.
    """
    _, out, new_state = run_if_routed(pred, tx, updates, state, params, **extra_args)
    return out, new_state


def run_if_routed(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[str, Any, Any]:
    """:func:`run_if`, also saying which route it took: ``fold``, ``select`` or ``cond``."""
    update_if = getattr(tx, "update_if", None)
    if update_if is not None:
        return ("fold", *update_if(pred, updates, state, params, **extra_args))
    if isinstance(tx, ClipTransform):
        return ("select", *run_and_select(pred, tx, updates, state, params, **extra_args))

    # One trace of the update, under a claim: a SkippableTransform inside it
    # (a wrapper's optimizer) folds pred in and marks the state it selected.
    operands, in_tree = jax.tree.flatten((updates, state))
    claim = FoldClaim(pred)
    folded: list[bool] = []

    def run(*leaves: Any) -> Any:
        out = tx.update(*jax.tree.unflatten(in_tree, leaves), params, **extra_args)
        active = getattr(_PENDING, "claim", None)
        selected = {id(leaf) for leaf in active.selected} if active is not None else set()
        folded[:] = [id(leaf) in selected for leaf in jax.tree.leaves(out[1])]
        return out

    with claim:
        traced, out_types = jax.make_jaxpr(run, return_shape=True)(*operands)
    out_tree = jax.tree.structure(out_types)
    update = _jaxpr_as_fun(traced)
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        # Op by op, as the transform's own update runs there (its Python may
        # compute on concrete values where the traced program cannot).
        def update(*leaves: Any) -> list[Any]:
            with FoldClaim(pred) if claim.claimed else contextlib.nullcontext():
                return jax.tree.leaves(run(*leaves))

    if claim.claimed:
        # A wrapper around a SkippableTransform runs every step; the rest of
        # its state (its count, hyperparameters, accumulators) is selected.
        out, new_state = jax.tree.unflatten(out_tree, update(*operands))
        kept = iter(folded)
        new_state = jax.tree.map(
            lambda n, o: n if next(kept) else _select(pred, n, o), new_state, state
        )
        return "fold", out, new_state

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

    def taken(leaves: list[Any]) -> list[Any]:
        return update(*leaves)

    def pass_through(leaves: list[Any]) -> list[Any]:
        return [_cast_like(x, t) for x, t in zip(leaves, jax.tree.leaves(out_types))]

    out_leaves = jax.lax.cond(pred, taken, pass_through, operands)
    return ("cond", *jax.tree.unflatten(out_tree, out_leaves))


def _jaxpr_as_fun(closed: Any) -> Callable[..., Any]:
    try:
        from jax.extend.core import jaxpr_as_fun
    except ImportError:  # jax < 0.4.38
        from jax.core import jaxpr_as_fun  # type: ignore[no-redef]
    return jaxpr_as_fun(closed)


def _select(pred: Array, new: Any, old: Any) -> Array:
    return jnp.where(pred, new, jnp.asarray(old, jnp.result_type(new)))


def _cast_like(x: Any, like: jax.ShapeDtypeStruct) -> Any:
    return x if jnp.result_type(x) == like.dtype else jnp.asarray(x).astype(like.dtype)


def run_and_select(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[Any, Any]:
    """``tx.update`` on every step; its new state only where ``pred`` holds.

    For transforms whose state is small (no full-size buffer to select).
    """
    out, new_state = tx.update(updates, state, params, **extra_args)
    return out, jax.tree.map(lambda n, o: jnp.where(pred, n, o), new_state, state)


def idle_metrics(metrics: dict[str, Array]) -> dict[str, Array]:
    """The metrics of a step on which the transform did not run.

    The one rule, also what :func:`clipjax.metrics` reports for the clippers
    inside a skipped ``skip_on_spike`` step: the per-step fields of
    :data:`clipjax._metrics.IDLE_VALUES` take the values of a step that
    changed nothing (``grad_norm`` 0, ``scale`` 1, ``clipped`` False, ...);
    thresholds, statistics and counters read as they stand.
    """
    return {
        key: jnp.full_like(value, IDLE_VALUES[key]) if key in IDLE_VALUES else value
        for key, value in metrics.items()
    }

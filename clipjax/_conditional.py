"""Running a transform on some steps only, with no full-size copy.

:func:`run_if` is the one way clipjax runs a transform on the steps a
predicate selects: ``skip_on_spike``'s inner optimizer, hist_clip's warm-up
clip, a chain's members. A :class:`SkippableTransform` (:func:`clipjax.adam`,
:func:`clipjax.adamw`, :func:`clipjax.chain`, built in
:mod:`clipjax._optimizers`) folds the predicate into its own arithmetic; a
clipjax clipper runs and has its small state selected; any other transform
runs under ``lax.cond``. On a step a transform did not run, its clipjax state
is left as it was, and :func:`clipjax.metrics` reports it as skipped.

The fold's gain over the conditional, from the compiled HLO of one donated
step (``skip_on_spike`` around AdamW on 25 layers of [256, 256] float32
weights and biases, jax 0.10 on CPU): 72.4 MB accessed and no full-size copy
around ``clipjax.adamw`` (AdamW alone: 65.8 MB), 105.3 MB and 50 full-size
copies around ``optax.adamw`` under ``lax.cond``; ``benchmarks/RESULTS.md``
has the step times.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from clipjax._kit import ClipTransform
from clipjax._metrics import IDLE_VALUES

Array = jax.Array


class SkippableTransform(optax.GradientTransformationExtraArgs):
    """An optax transform that can also skip a step: ``update_if``.

    A ``SkippableTransform`` is an ``optax.GradientTransformationExtraArgs``
    and goes wherever optax takes a transform. It adds one attribute,
    ``update_if(pred, updates, state, params=None, **extra_args)``, where
    ``pred`` is a scalar bool: where True it computes what ``update``
    computes, in the same order (XLA may fuse a multiply and an add
    differently in the two programs, so the last bit of a value can differ);
    where False it returns zero updates (each leaf in its dtype) and the state
    as it was, bit for bit, even for NaN or infinite updates. The choice is
    made element-wise inside the update's own arithmetic, so
    :func:`clipjax.skip_on_spike` around one compiles to one fused loop per
    leaf: no conditional, no extra pass over the updates.
    :func:`clipjax.adam`, :func:`clipjax.adamw` and :func:`clipjax.chain`
    return one. Inside a wrapper with no ``update_if`` of its own
    (``optax.inject_hyperparams(clipjax.adamw)(...)``), ``update`` computes
    ``update_if`` with skip_on_spike's decision while skip_on_spike runs the
    wrapper, and is optax's anywhere else.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.adam(0.1)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> updates, new = tx.update_if(False, {"w": jnp.array([jnp.nan, 1.0])}, state)
      >>> updates["w"].tolist(), int(new[0].count)
      ([0.0, 0.0], 0)
    """

    update_if: Callable[..., tuple[Any, Any]] | None = None


def skippable_step(init: Callable[..., Any], step: Callable[..., Any]) -> SkippableTransform:
    """:func:`skippable` from one ``step(pred, updates, state, params)``: ``update``
    passes ``pred=None``, ``keep_state_if`` the boolean ``pred``."""

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
    """A ``SkippableTransform`` from its ``update_if``, or from ``keep_state_if``:
    ``update_if`` without zeroing the updates where ``pred`` is False.

    :func:`clipjax.chain` runs its members through ``keep_state_if`` where they
    have one and zeroes the updates once, after the last member: a select per
    member would be compiled into every leaf's fused loop.
    """
    if update_if is None:
        assert keep_state_if is not None
        update_if = _zeroing(keep_state_if)

    def update_or_fold(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        # Inside a wrapper (inject_hyperparams, MultiSteps) that skip_on_spike
        # runs, fold its decision in (see FoldClaim); otherwise update.
        return fold_or_update(update, update_if, updates, state, params, **extra_args)

    tx = SkippableTransform(init, update_or_fold)
    tx.update_if = update_if
    if keep_state_if is not None:
        tx.keep_state_if = keep_state_if  # pyright: ignore[reportAttributeAccessIssue]
    return tx


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

    Where ``pred`` is False the returned updates are not ``tx``'s: the caller
    masks them. Each route is free of full-size copies in the compiled step:

    * ``"fold"``: a :class:`SkippableTransform` folds ``pred`` into its
      arithmetic (its ``update_if``); a transform that calls one's ``update``
      (``optax.inject_hyperparams(clipjax.adamw)(...)``, ``optax.MultiSteps``)
      runs every step under a :class:`FoldClaim`, found by tracing its update
      once (the same trace then runs), and the rest of its state is selected;
    * ``"select"``: a clipjax clipper holds small ``[groups]`` arrays: it runs
      every step and its state is selected (its norms are the ones the caller
      computes anyway, and XLA merges the identical reductions);
    * ``"cond"``: any other transform runs under ``lax.cond``. Its
      pass-through branch must be branch 0 (the false branch) and return its
      operands as they are: only then does XLA elide the buffer copies. Zeros,
      or the update computed unconditionally with the moments selected after,
      copy the state or the updates every step. The branches return the inner
      update's own output types (from ``jax.make_jaxpr``): where it changes a
      dtype, the pass-through branch casts its operands to them.
    """
    _, out, new_state = run_if_routed(pred, tx, updates, state, params, **extra_args)
    return out, new_state


def run_if_routed(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[str, Any, Any]:
    """:func:`run_if`, also saying which route it took: ``fold``, ``select`` or ``cond``."""
    if isinstance(tx, SkippableTransform):
        # Folded into its own arithmetic (clipjax.adam: _optimizers.adam_arithmetic).
        assert tx.update_if is not None
        return ("fold", *tx.update_if(pred, updates, state, params, **extra_args))
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
    """The metrics of a step on which the transform did not run (hist_clip's warm-up
    clip on the groups past their warm-up).

    The per-step fields of :data:`clipjax._metrics.IDLE_VALUES` take the values
    of a step that changed nothing (``grad_norm`` 0, ``scale`` 1, ``clipped``
    False, ...); thresholds, statistics and counters read as they stand. A
    clipper inside a skipped ``skip_on_spike`` step reads as skipped instead
    (:data:`clipjax._metrics.SKIPPED_VALUES`: ``grad_norm`` NaN, ``skipped``
    True), in :func:`clipjax.metrics`' view.
    """
    return {
        key: jnp.full_like(value, IDLE_VALUES[key]) if key in IDLE_VALUES else value
        for key, value in metrics.items()
    }

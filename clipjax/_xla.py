"""Workarounds for what XLA's compiler does to a clipper's step, each with its reason.

None changes a value; the tests named at each one measure what it prevents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from clipjax._grouping import Grouping, stacks_of

Array = jax.Array


def leaf_index(grouping: Grouping, placeholder: bool = False) -> Any:
    """Each leaf's group index as an int32 array of its own, carried in the state.

    Why: read at this runtime offset, ``scale[g]`` is not folded into each
    leaf's fusion, so the fusions of one shape are identical and compiled once
    (``tests/contract/test_compile.py`` counts the distinct fusions). Empty for
    a single group; a stacked leaf's entry is the ``[layers]`` vector of its
    slices' groups; one scalar on optax's params placeholder.
    """
    if placeholder:
        return jnp.zeros((), jnp.int32)
    if grouping.num_groups == 1:
        return ()
    return tuple(
        jnp.asarray(g if st is None else st[1], jnp.int32)
        for g, st in zip(grouping.leaf_groups, stacks_of(grouping, len(grouping.leaf_groups)))
    )


def returned(x: Any) -> Any:
    """``x``'s arrays copied: an output that passes its input through cannot reuse its donated
    buffer."""
    return jax.tree.map(jnp.copy, x)


def own_buffers(state: Any) -> Any:
    """Gives every leaf of a new state its own buffer, so that donating the state donates none
    twice."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def computed_once(x: Array) -> Array:
    """``x`` itself, computed once where XLA would copy its computation into every consumer.

    Why: XLA fuses cheap operations into each fusion that reads them, compiling
    them once per leaf (``tests/contract/test_compile.py``). XLA:CPU drops
    ``lax.optimization_barrier``; a sort is never fused, and sorting two equal
    copies of ``x`` returns ``x``'s own bits.
    """
    return jnp.sort(jnp.stack([x, x]), axis=0)[0]


def after(x: Array, first: Array) -> Array:
    """``x`` (unchanged) with a data dependency on one element of ``first``.

    Why: where one loop reads a buffer and a later loop overwrites it in place,
    XLA copies the buffer unless the later loop must wait for the first.
    Adding ``first[0] >> 31 >> 1`` (always 0, never folded) orders them
    (``tests/spam/test_spam_pieces.py`` counts the copies). And: jaxlib's
    batched LAPACK kernels (``svd``, ``qr``) each wait on the intra-op thread
    pool for their batch's tasks; run side by side, as many as the pool has
    threads wait for each other for ever (seen on two cores, jaxlib 0.10).
    spectral_clip orders its decompositions one after another
    (``tests/spectral_clip/test_spectral_clip.py`` runs a tree that hung).
    """
    if first.size == 0:
        return x
    bits = jax.lax.bitcast_convert_type(first.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
    zero = jax.lax.shift_right_logical(
        jax.lax.shift_right_logical(bits, jnp.uint32(31)), jnp.uint32(1)
    )
    return x + zero.astype(x.dtype)


def per_leaf(fn: Callable[..., Any], *shared: Any) -> Callable[..., Any]:
    """``fn(*leaf_args, *shared)``, traced once for all the leaves of one signature.

    Why: a step's per-leaf arithmetic, traced once per leaf, makes a few
    hundred leaves' step slow to trace and to compile. Under an outer trace
    ``fn`` runs under ``jax.jit``, so leaves of the same shapes and dtypes
    share one trace (``tests/contract/test_compile.py`` counts the jaxpr
    equations per leaf); the arrays among ``shared`` become arguments, the
    rest stays constant. Called eagerly, ``fn`` runs as it is.
    """
    flat, tree = jax.tree.flatten(shared)
    is_array = [isinstance(x, (jax.Array, Tracer)) for x in flat]
    arrays = [x for x, a in zip(flat, is_array) if a]

    def with_arrays(leaf_args: tuple[Any, ...], values: list[Any]) -> Any:
        given = iter(values)
        rebuilt = [next(given) if a else x for x, a in zip(flat, is_array)]
        return fn(*leaf_args, *jax.tree.unflatten(tree, rebuilt))

    # Profiles and HLO metadata name the per-leaf call after fn.
    with_arrays.__name__ = with_arrays.__qualname__ = getattr(fn, "__name__", "per_leaf")
    jitted = jax.jit(with_arrays)

    def call(*leaf_args: Any) -> Any:
        if any(isinstance(x, Tracer) for x in jax.tree.leaves(leaf_args)):
            return jitted(leaf_args, arrays)
        return fn(*leaf_args, *shared)

    return call


def fused_sums(*terms: jax.Array) -> tuple[jax.Array, ...]:
    """The sums of several same-shape element-wise terms, in one read.

    Why: XLA:CPU fuses no reduction into another, so separate sums read the
    leaf once each; one variadic reduce reads it once (the bytes accessed that
    ``tests/release/test_benchmarks.py`` checks).
    """
    flat = tuple(t.reshape(-1) for t in terms)
    zeros = tuple(jnp.zeros((), t.dtype) for t in flat)
    return tuple(jax.lax.reduce(flat, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), (0,)))


def adam_state_dtypes(update: Callable[..., Any], updates: Any, state: Any, params: Any) -> Any:
    """The ``optax.ScaleByAdamState`` that ``update`` returns, as ``jax.ShapeDtypeStruct`` leaves.

    Why: the folded skip (``clipjax.adam``'s ``update_if``) must return the
    state in the dtypes optax's own update gives it (optax >= 0.2.6 casts
    ``nu`` back to its dtype; 0.2.5 does not). ``jax.eval_shape`` of the whole
    update traces every leaf's arithmetic a second time; traced on one scalar
    per distinct signature it costs one leaf's.
    """
    u, m, v = (jax.tree.leaves(t) for t in (updates, state.mu, state.nu))
    p = None if params is None else jax.tree.leaves(params)
    if not len(u) == len(m) == len(v) or (p is not None and len(p) != len(u)):
        return jax.eval_shape(update, updates, state, params)[1]

    def sig(x: Any) -> tuple[Any, bool]:
        # jax.typeof is newer than the oldest jax clipjax supports (0.4.36).
        aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)  # pyright: ignore
        return aval.dtype, bool(getattr(aval, "weak_type", False))

    keys = [tuple(sig(x) for x in row) for row in zip(u, m, v, *([p] if p is not None else []))]
    unique = list(dict.fromkeys(keys))
    small = lambda i: [jax.ShapeDtypeStruct((), k[i][0], weak_type=k[i][1]) for k in unique]
    out = jax.eval_shape(
        update, small(0), state._replace(mu=small(1), nu=small(2)), small(3) if p else None
    )[1]
    at = {k: i for i, k in enumerate(unique)}

    def like(tree: Any, leaves: list[Any], new: list[Any]) -> Any:
        typed = [jax.ShapeDtypeStruct(jnp.shape(x), new[at[k]].dtype) for x, k in zip(leaves, keys)]
        return jax.tree.unflatten(jax.tree.structure(tree), typed)

    return state._replace(
        count=out.count,
        mu=like(state.mu, m, jax.tree.leaves(out.mu)),
        nu=like(state.nu, v, jax.tree.leaves(out.nu)),
    )

"""Workarounds for what XLA's compiler does to a clipper's step, each with its reason.

None changes a value; the tests named at each one measure what it prevents.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

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
    (``tests/spam/test_spam_pieces.py`` counts the copies).
    """
    if first.size == 0:
        return x
    bits = jax.lax.bitcast_convert_type(first.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
    zero = jax.lax.shift_right_logical(
        jax.lax.shift_right_logical(bits, jnp.uint32(31)), jnp.uint32(1)
    )
    return x + zero.astype(x.dtype)

"""Workarounds for what XLA's compiler does to a clipper's step, each with its reason.

None of these changes a value: each shapes the program so that XLA compiles
it once per leaf shape instead of once per leaf, or lets a donated state's
buffers be reused instead of copied. The tests named at each one measure
what it prevents.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from clipjax._grouping import Grouping, stacks_of

Array = jax.Array


def leaf_index(grouping: Grouping, placeholder: bool = False) -> Any:
    """Each leaf's group index as an int32 array of its own, carried in the state.

    Why: a leaf reads its group's scale as ``scale[g]``. With ``g`` a constant,
    XLA folds it into the leaf's fusion, every leaf's fusion differs and code
    generation runs once per leaf; read at a runtime offset (this index), the
    fusions of one shape are identical and compiled once: about 3x less
    compile time at 1,000 leaves ``per_param``
    (``tests/contract/test_compile.py`` counts the distinct fusions).

    Empty for a single group; a stacked leaf's entry is the ``[layers]`` vector
    of its slices' groups. On optax's params placeholder (``tree_map_params``)
    one scalar stands for the tuple, so that the placeholder's state is a
    prefix of the real one.
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
    """``x``'s arrays copied, for a new state that would pass its input through.

    Why: a jitted step's output that is its input passed through cannot reuse
    that input's donated buffer, and JAX warns about it
    (``tests/skip_on_spike/test_skip_on_spike_steps.py::test_buffers_can_be_donated``
    turns the warning into an error).
    """
    return jax.tree.map(jnp.copy, x)


def own_buffers(state: Any) -> Any:
    """Gives every leaf of a new state its own buffer.

    Why: ``init`` builds several fields from one ``zeros``; a jitted step that
    donates the state would donate that buffer twice and fail
    (``tests/contract/test_contract.py::test_state_can_be_donated``).
    """
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def computed_once(x: Array) -> Array:
    """``x`` itself, computed once where XLA would copy its computation into every consumer.

    Why: XLA fuses a chain of cheap operations (compares, selects) into each
    fusion that reads its result, so a group's scale or a skip decision is
    recomputed in every leaf's fusion and compiled once per leaf
    (``tests/contract/test_compile.py`` bounds the instructions a leaf adds).
    XLA:CPU drops ``lax.optimization_barrier``; a sort is never fused into its
    consumers, and sorting two copies of ``x`` along a new axis returns
    ``x``'s own bits (the elements it permutes are equal).
    """
    return jnp.sort(jnp.stack([x, x]), axis=0)[0]


def after(x: Array, first: Array) -> Array:
    """``x`` (unchanged) with a data dependency on one element of ``first``.

    Why: where one loop reads a buffer (Adam's old ``v``, read by SPAM's clip
    and AdamWClip's count) and a later loop overwrites it in place, XLA copies
    the buffer unless the later loop must wait for the first: a full-size copy
    per leaf, every step. ``lax.optimization_barrier`` does not survive to
    copy insertion on XLA:CPU. Adding ``first[0] >> 31 >> 1`` (always 0, never
    folded) to ``x`` orders them at the cost of reading one element
    (``tests/spam/test_spam_pieces.py`` counts the copies).
    """
    if first.size == 0:
        return x
    bits = jax.lax.bitcast_convert_type(first.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
    zero = jax.lax.shift_right_logical(
        jax.lax.shift_right_logical(bits, jnp.uint32(31)), jnp.uint32(1)
    )
    return x + zero.astype(x.dtype)

"""The two QK-Clip mistakes 0.4.0 let pass without a word, now loud (issue 50, item 7).

(a) ``[d_model, heads * head_dim]`` kernels without ``head_axis=-1``: 0.4.0 read them along
``-2`` and rescaled blocks of input rows (examples/qk_clip_muon.py, 150 steps: 48 steps with
a head clipped where the right wiring clips 32). A leaf that splits into the heads along both
of its last axes is now refused, naming the leaf and ``head_axis``.

(b) ``optax.chain(qk_clip(...), muon)``, the rescale before the optimizer: 0.4.0 ran it (the
largest max logit after a step 578.93 in 150 steps, Muon alone 248.84). ``qk_clip(muon, tau)``
now wraps the optimizer; the 0.4 call ``qk_clip(tau)`` is refused with the new form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

TAU = 10.0
D, HEADS, HEAD_DIM = 16, 4, 4


def square_params() -> dict[str, Any]:
    """examples/qk_clip_muon.py's layout: square [d_model, heads * head_dim] kernels."""
    keys = iter(jax.random.split(jax.random.key(0), 4))
    layer = lambda: {n: jax.random.normal(next(keys), (D, HEADS * HEAD_DIM)) for n in ("wq", "wk")}
    return {"layers": [{"attn": layer()}, {"attn": layer()}]}


LOGITS = jnp.array([[1.0, 40.0, 5.0, 12.5], [30.0, 1.0, 1.0, 1.0]])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_square_flattened_kernel_without_head_axis_is_refused(jit: bool) -> None:
    params = square_params()
    tx = clipjax.qk_clip(optax.sgd(0.1), TAU, query="wq", key="wk")
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    message = (
        r"qk_clip: key leaf layers/0/attn/wk \(one layer: \(16, 16\)\) splits into 4 heads "
        r"along axis -2 \(16 entries\) and along axis -1 \(16\): give head_axis= \(-1 for "
        r"\[d_model, heads \* head_dim\]"
    )
    with pytest.raises(ValueError, match=message):
        update(params, state, params, max_logits=LOGITS)


def test_a_key_with_fewer_heads_is_refused_too() -> None:
    """GQA: the query leaf [12, 32] splits along -1 only, the key [12, 8] along both."""
    params = {"attn": {"wq": jnp.ones((12, 8 * 4)), "wk": jnp.ones((12, 2 * 4))}}
    tx = clipjax.qk_clip(optax.sgd(0.1), TAU, query="wq", key="wk", kv_heads=2)
    with pytest.raises(ValueError, match=r"key leaf attn/wk .* splits into 2 heads.*head_axis="):
        tx.update(params, tx.init(params), params, max_logits=jnp.full((8,), 50.0))


def test_head_axis_given_rescales_the_heads() -> None:
    params = square_params()
    tx = clipjax.qk_clip(optax.identity(), TAU, query="wq", key="wk", head_axis=-1)
    zero = jax.tree.map(jnp.zeros_like, params)  # the optimizer's step: none
    out, state = tx.update(zero, tx.init(params), params, max_logits=LOGITS)
    new = optax.apply_updates(params, out)
    for layer, row in zip(range(2), np.asarray(LOGITS)):
        for name in ("wq", "wk"):
            given = np.asarray(params["layers"][layer]["attn"][name]).reshape(D, HEADS, HEAD_DIM)
            got = np.asarray(new["layers"][layer]["attn"][name]).reshape(D, HEADS, HEAD_DIM)
            factor = np.sqrt(np.minimum(1.0, TAU / row))
            np.testing.assert_allclose(got, given * factor[None, :, None], rtol=2e-6)
    m = clipjax.metrics(state)
    assert int(m["qk_clip/layers/0/attn/clipped_heads"]) == 2
    assert int(m["qk_clip/layers/1/attn/clipped_heads"]) == 1


@pytest.mark.parametrize(
    ("shape", "head_axis"),
    [((12, 4, 4), -2), ((4, 4), -2), ((13, 16), -1), ((16,), -1), ((16, 13), -2)],
    ids=["flax kernel", "flax bias", "flattened", "flattened bias", "transposed"],
)
def test_an_unambiguous_layout_is_read_as_if_given(shape: tuple, head_axis: int) -> None:
    """flax's [..., heads, head_dim] (the axis before the last holds exactly the heads), and
    leaves of which one axis only splits: inferred, the same as with head_axis given."""
    params = {"attn": {"q": jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 1}}
    params["attn"]["k"] = 2 * params["attn"]["q"]
    s = jnp.array([1.0, 40.0, 5.0, 12.5])
    outs = []
    for axis in (None, head_axis):
        tx = clipjax.qk_clip(optax.identity(), TAU, query="q", key="k", head_axis=axis)
        outs.append(tx.update(params, tx.init(params), params, max_logits=s)[0])
    jax.tree.map(np.testing.assert_array_equal, *outs)
    assert not np.array_equal(outs[0]["attn"]["q"], params["attn"]["q"])


def test_one_key_head_is_the_whole_leaf_on_either_axis() -> None:
    """MQA: a [d, head_dim] key splits into one head along both axes, the same factor."""
    params = {"attn": {"wq": jnp.ones((13, 6 * 4)), "wk": jnp.ones((13, 4))}}
    tx = clipjax.qk_clip(optax.identity(), TAU, query="wq", key="wk", kv_heads=1)
    s = jnp.array([1.0, 40.0, 5.0, 12.5, 1.0, 1.0])
    zero = jax.tree.map(jnp.zeros_like, params)
    out, _ = tx.update(zero, tx.init(params), params, max_logits=s)
    new = optax.apply_updates(params, out)
    np.testing.assert_allclose(new["attn"]["wk"], np.sqrt(TAU / 40.0), rtol=1e-6)
    np.testing.assert_allclose(new["attn"]["wq"], np.sqrt(TAU / 40.0), rtol=1e-6)


def test_the_0_4_call_and_no_optimizer_are_refused() -> None:
    message = (
        r"qk_clip: optimizer must be an optax GradientTransformation.*got 100\.0 \(tau=100\.0 "
        r"first, as in 0\.4\? .*clipjax\.qk_clip\(optax\.contrib\.muon\(\.\.\.\), tau=100\.0\)"
    )
    with pytest.raises(ValueError, match=message):
        optax.chain(clipjax.qk_clip(100.0, query="wq", key="wk"), optax.sgd(0.1))
    with pytest.raises(ValueError, match="optimizer must be an optax GradientTransformation"):
        clipjax.qk_clip("muon")
    with pytest.raises(TypeError, match="optimizer"):
        clipjax.qk_clip(tau=100.0)  # pyright: ignore[reportCallIssue]


def test_the_rescale_follows_the_optimizer() -> None:
    """qk_clip(opt) is opt's step, then the K2 rescale of opt's new weights, and its state
    holds opt's state as opt alone leaves it."""
    params = square_params()
    grads = jax.tree.map(lambda p: 0.3 * p + 0.1, params)
    optimizer = optax.adam(0.05)
    tx = clipjax.qk_clip(optimizer, TAU, query="wq", key="wk", head_axis=-1)
    state = tx.init(params)
    alone_state = optimizer.init(params)
    for _ in range(2):
        out, state = tx.update(grads, state, params, max_logits=LOGITS)
        want, alone_state = optimizer.update(grads, alone_state, params)
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, alone_state)
    weights = optax.apply_updates(params, want)
    new = optax.apply_updates(params, out)
    factor = np.sqrt(np.minimum(1.0, TAU / np.asarray(LOGITS[0])))
    got = np.asarray(new["layers"][0]["attn"]["wq"]).reshape(D, HEADS, HEAD_DIM)
    kept = np.asarray(weights["layers"][0]["attn"]["wq"]).reshape(D, HEADS, HEAD_DIM)
    np.testing.assert_allclose(got, kept * factor[None, :, None], rtol=2e-6, atol=1e-7)


def test_max_logits_may_be_a_function_of_the_new_weights() -> None:
    params = square_params()
    grads = jax.tree.map(lambda p: 0.3 * p, params)
    tx = clipjax.qk_clip(optax.sgd(0.5), TAU, query="wq", key="wk", head_axis=-1)
    seen = []

    def max_logits(new: Any) -> jax.Array:
        seen.append(new)
        return LOGITS

    out, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, max_logits=max_logits))(
        grads, tx.init(params), params
    )
    want, _ = tx.update(grads, tx.init(params), params, max_logits=LOGITS)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, want)
    assert len(seen) == 1 and jax.tree.structure(seen[0]) == jax.tree.structure(params)


def test_the_optimizer_gets_the_extra_args() -> None:
    params = square_params()
    got = []

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        got.append(sorted(extra))
        return updates, state

    spy = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = clipjax.qk_clip(spy, TAU, query="wq", key="wk", head_axis=-1)
    tx.update(params, tx.init(params), params, max_logits=LOGITS, value=jnp.ones(()))
    assert got == [["value"]]

"""``adaclip``, ``ada_norm``, ``spam`` and ``stable_spam`` without a reference: a lasting
shift, adaclip's scopes against NumPy, the fold, optax's moments, inject_hyperparams and
arguments refused by name (the traces against pytorch-optimizer: test_spam.py)."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import compiled_train_step, full_size_conditionals, full_size_copies
from tests.references.spam import spiky_gradients
from tests.skip_streams import tree_equal
from tests.spam.test_spam import PARAMS, SHAPES


def scan_metrics(tx: Any, scales: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """``clipjax.metrics`` after each step of Gaussian gradients times ``scales``."""
    params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros((8,))}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(scales))

    def step(state: Any, xs: Any) -> Any:
        key, scale = xs
        k1, k2 = jax.random.split(key)
        g = {"w": scale * jax.random.normal(k1, (8, 8)), "b": scale * jax.random.normal(k2, (8,))}
        _, state = tx.update(g, state, params)
        return state, clipjax.metrics(state)

    _, metrics = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(
        tx.init(params), (keys, jnp.asarray(scales, jnp.float32))
    )
    return jax.device_get(metrics)


def test_adaclip_bound_follows_a_lasting_shift() -> None:
    """After a x10 rise of the gradient scale the bound catches up; nothing stays clipped."""
    before, after = 500, 4000
    scales = np.r_[np.ones(before), 10 * np.ones(after)]
    m = scan_metrics(clipjax.adaclip(), scales)
    bound, grad_max = m["adaclip/w/bound"], m["adaclip/w/grad_max"]
    level = np.median(grad_max[before:])
    assert np.median(bound[before - 50 : before]) < 0.2 * level
    # An EMA with theta = 0.999: 90% of the way after ln(10) / 0.001 = 2303 steps.
    assert np.median(bound[before + 2400 : before + 2600]) > 0.85 * level
    assert np.median(bound[-200:]) > 0.95 * level
    clipped = m["adaclip/w/clipped_fraction"]
    assert clipped[before : before + 100].mean() > 10 * clipped[-500:].mean()
    assert m["adaclip/w/count"][-1] == before + after


def test_ada_norm_follows_a_lasting_shift() -> None:
    """AdaGN's mean norm reaches the new level within tens of steps; the target stays near 1."""
    scales = np.r_[np.ones(200), 10 * np.ones(200)]
    m = scan_metrics(clipjax.ada_norm(scope="global"), scales)
    norm, mean = m["ada_norm/global/grad_norm"], m["ada_norm/global/mean"]
    level = np.median(norm[200:])
    assert np.median(mean[150:200]) < 0.2 * level
    np.testing.assert_allclose(np.median(mean[250:]), level, rtol=0.05)
    target = m["ada_norm/global/target_norm"]
    assert 0.9 < np.median(target[250:]) <= 1.0
    np.testing.assert_allclose(m["ada_norm/global/scale"] * norm, target, rtol=1e-5)


def test_adaclip_scopes_match_a_numpy_restatement() -> None:
    """global / per_layer / per_param: the bound of each group is its own EMA of maxima."""
    rng = np.random.default_rng(3)
    params = {"l1": {"w": np.zeros((3, 4)), "b": np.zeros(4)}, "l2": {"w": np.zeros((4, 2))}}
    grads = [
        jax.tree.map(lambda p, t=t: rng.standard_normal(p.shape) * (1 + 20 * (t == 7)), params)
        for t in range(12)
    ]
    groups = {
        "global": {"global": ["l1/b", "l1/w", "l2/w"]},
        "per_layer": {"l1": ["l1/b", "l1/w"], "l2": ["l2/w"]},
        "per_param": {"l1/b": ["l1/b"], "l1/w": ["l1/w"], "l2/w": ["l2/w"]},
    }
    theta = 0.9
    for scope, members in groups.items():
        tx = clipjax.adaclip(theta, scope=scope)
        update = jax.jit(tx.update)
        state = tx.init(params)
        assert state.info.groups == tuple(members)
        ema = dict.fromkeys(members, 0.0)
        for t, g in enumerate(grads):
            out, state = update(jax.tree.map(jnp.float32, g), state)
            flat = {clipjax.path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(g)}
            got = {clipjax.path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(out)}
            for group, leaves in members.items():
                biggest = max(np.abs(flat[n]).max() for n in leaves)
                ema[group] = theta * ema[group] + (1 - theta) * biggest
                bound = ema[group] / (1 - theta ** (t + 1))
                for n in leaves:
                    x = flat[n]
                    expected = np.where(np.abs(x) > bound, x / biggest * bound, x)
                    np.testing.assert_allclose(got[n], expected, rtol=2e-6, err_msg=(scope, t))
                m = clipjax.metrics(state)
                np.testing.assert_allclose(m[f"adaclip/{group}/bound"], bound, rtol=2e-6)
    # Without the count: the same clipped gradients, the same bound and norms.
    for count_clipped in (True, False):
        tx = clipjax.adaclip(theta, scope="per_layer", count_clipped=count_clipped)
        state = tx.init(params)
        for g in grads:
            out, state = jax.jit(tx.update)(jax.tree.map(jnp.float32, g), state)
        if count_clipped:
            expected, counted = out, clipjax.metrics(state)
    uncounted = clipjax.metrics(state)
    chex.assert_trees_all_close(out, expected, rtol=1e-6)
    assert set(counted) - set(uncounted) == {f"adaclip/{k}/clipped_fraction" for k in ("l1", "l2")}
    chex.assert_trees_all_close(uncounted, {k: counted[k] for k in uncounted}, rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: clipjax.spam(1e-2, reset_interval=3, warmup_steps=2, clip_delay=1),
    lambda: clipjax.stable_spam(1e-2, reset_interval=3, weight_decay=0.1),
], ids=["spam", "stable_spam"])  # fmt: skip
def test_update_if_skips_bit_identically_and_takes_as_update(make: Any) -> None:
    tx = make()
    params = {k: jnp.asarray(v) for k, v in PARAMS.items()}
    state = tx.init(params)
    skip = jax.jit(lambda g, s, p: tx.update_if(False, g, s, p))
    for g in spiky_gradients(SHAPES, 5, element_spikes={3: 1e4}):
        g = {k: jnp.asarray(v) for k, v in g.items()}
        for bad in (None, np.nan, np.inf):
            dirty = g if bad is None else {**g, "w": g["w"].at[1, 2].set(bad)}
            skipped, kept = skip(dirty, state, params)
            assert tree_equal(kept, state)
            chex.assert_trees_all_equal(skipped, jax.tree.map(jnp.zeros_like, g), strict=True)
        with jax.disable_jit():
            taken = tx.update_if(jnp.bool_(True), g, state, params)
            updates, state = tx.update(g, state, params)
        assert tree_equal(taken, (updates, state))
        params = optax.apply_updates(params, updates)


@pytest.mark.parametrize("make", [
    lambda: clipjax.spam(1e-3),
    lambda: clipjax.spam(1e-3, weight_decay=0.1, count_clipped=False),
    lambda: clipjax.stable_spam(1e-3, weight_decay=0.1),
], ids=["spam", "spam_uncounted", "stable_spam"])  # fmt: skip
def test_the_donated_step_has_no_conditional_and_no_copy(make: Any) -> None:
    """Around skip_on_spike, as clipjax.adamw (test_fold.py). The clip's limit is read by the
    first moment's loop and overwritten by the second's: without clipjax._xla.after, XLA
    copies v."""
    compiled, _ = compiled_train_step(clipjax.skip_on_spike(make()))
    text = compiled.as_text()
    assert full_size_copies(text, {(64, 64), (64,)}) == 0
    assert full_size_conditionals(text, {(64, 64), (64,)}) == 0


def test_alone_it_copies_no_more_than_adamw() -> None:
    """Alone, this step copies the parameters the backward pass read, as optax.adamw."""
    shapes = {(64, 64), (64,)}
    adamw, _ = compiled_train_step(clipjax.adamw(1e-3, weight_decay=0.1))
    for tx in (clipjax.spam(1e-3, weight_decay=0.1), clipjax.stable_spam(1e-3)):
        compiled, _ = compiled_train_step(tx)
        assert full_size_copies(compiled.as_text(), shapes) <= full_size_copies(
            adamw.as_text(), shapes
        )


def test_the_moments_are_optax_adams() -> None:
    """Checkpoints look like optax's: the moments are a ``ScaleByAdamState``."""
    params = {k: jnp.asarray(v) for k, v in PARAMS.items()}
    state = clipjax.spam(1e-3).init(params)
    adam = optax.adam(1e-3).init(params)[0]
    assert isinstance(state[0][0], optax.ScaleByAdamState)
    chex.assert_trees_all_equal(state[0][0], adam)
    assert isinstance(state[0][1], clipjax.SpamState)
    assert optax.tree_utils.tree_get(state, "nu") is state[0][0].nu


def test_inject_hyperparams() -> None:
    params = {k: jnp.asarray(v) for k, v in PARAMS.items()}
    g = {k: jnp.asarray(v) for k, v in spiky_gradients(SHAPES, 1)[0].items()}
    for factory, kw in [
        (clipjax.spam, dict(learning_rate=1e-2, threshold=3.0, weight_decay=0.1)),
        (clipjax.stable_spam, dict(learning_rate=1e-2, theta=0.99, gamma1=0.8)),
    ]:
        injected = optax.inject_hyperparams(factory)(**kw)
        plain = factory(**kw)
        state, expected_state = injected.init(params), plain.init(params)
        for _ in range(3):
            out, state = jax.jit(injected.update)(g, state, params)
            expected, expected_state = jax.jit(plain.update)(g, expected_state, params)
            chex.assert_trees_all_close(out, expected, rtol=2e-5)


SPAM, STABLE = clipjax.spam, clipjax.stable_spam
BAD = [(SPAM, {"reset_interval": 0}), (SPAM, {"warmup_steps": -1}), (SPAM, {"clip_delay": 1.5}),
       (SPAM, {"threshold": -1.0}), (SPAM, {"b2": 1.0}), (STABLE, {"reset_interval": 0}),
       (STABLE, {"theta": 1.0}), (clipjax.adaclip, {"theta": 0.0}),
       (clipjax.ada_norm, {"gamma1": 1.5}), (clipjax.ada_norm, {"scope": "per_row"}),
       (SPAM, {"name": ""})]  # fmt: skip


@pytest.mark.parametrize(("call", "match"), [(lambda f=f, kw=kw: f(**kw), *kw) for f, kw in BAD])
def test_bad_arguments_name_themselves(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()

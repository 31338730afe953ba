"""One contract, every public transform: the checks optax users rely on.

For each transform: state structure, shapes and dtypes identical after
updates, with and without ``jit`` (``chex.variants``); works as a ``lax.scan``
carry; traced once across steps; no host transfer inside ``update``; each
leaf's dtype preserved; ``metrics()`` finds the state inside every optax
wrapper; ``inject_hyperparams`` works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import clipjax

Factory = Callable[[], optax.GradientTransformation]

# name -> (factory, metric prefix, a field every state of it records)
TRANSFORMS: dict[str, tuple[Factory, str, str]] = {
    "clip_by_global_norm": (
        lambda: clipjax.clip_by_global_norm(1.0),
        "clip_by_global_norm",
        "scale",
    ),
    "clip_by_global_norm_inf": (
        lambda: clipjax.clip_by_global_norm(1.0, norm_type=float("inf")),
        "clip_by_global_norm",
        "grad_norm",
    ),
    "zclip": (lambda: clipjax.zclip(warmup_steps=2), "zclip", "threshold"),
    "zclip_per_param": (lambda: clipjax.zclip(warmup_steps=2, scope="per_param"), "zclip", "z"),
    "hist_clip": (lambda: clipjax.hist_clip(warmup_steps=2), "hist_clip", "threshold"),
    "hist_clip_ema_per_layer": (
        lambda: clipjax.hist_clip(clipjax.ema_criterion(), warmup_steps=2, scope="per_layer"),
        "hist_clip",
        "mean",
    ),
    "agc": (lambda: clipjax.agc(), "agc", "target"),
    "agc_per_layer": (lambda: clipjax.agc(scope="per_layer"), "agc", "weight_norm"),
    "adagc": (lambda: clipjax.adagc(warmup_steps=2), "adagc", "threshold"),
    "adaclip": (lambda: clipjax.adaclip(0.9), "adaclip", "clipped_fraction"),
    "adaclip_global": (
        lambda: clipjax.adaclip(scope="global", count_clipped=False),
        "adaclip",
        "bound",
    ),
    "ada_norm": (lambda: clipjax.ada_norm(), "ada_norm", "target_norm"),
    "ada_norm_per_layer": (lambda: clipjax.ada_norm(scope="per_layer"), "ada_norm", "mean"),
}
# Whole optimizers (full-size moments in their states): the contract here, not
# the clipper-only checks of test_compat.py.
OPTIMIZERS: dict[str, tuple[Factory, str, str]] = {
    "spam": (
        lambda: clipjax.spam(1e-2, reset_interval=4, warmup_steps=2, clip_delay=1),
        "spam",
        "resets",
    ),
    "stable_spam": (lambda: clipjax.stable_spam(1e-2, reset_interval=4), "stable_spam", "resets"),
    "stable_spam_uncounted": (
        lambda: clipjax.stable_spam(1e-2, reset_interval=4, count_clipped=False),
        "stable_spam",
        "resets",
    ),
}
# Transforms whose metrics hold no gradient norm (spam reports its clip per element).
NORMLESS = {"spam"}

OPTIONAL = {
    "autoclip": (lambda: clipjax.autoclip(warmup_steps=2, min_history=2), "autoclip", "median"),
    "autoclip_window": (
        lambda: clipjax.autoclip(mode="percentile", window_size=4, warmup_steps=2, min_history=2),
        "autoclip",
        "quantile",
    ),
    "autoclip_ema_per_param": (
        lambda: clipjax.autoclip(mode="percentile", history="ema", scope="per_param"),
        "autoclip",
        "quantile",
    ),
    "zscore_clip": (
        lambda: clipjax.zscore_clip(warmup_steps=2, min_history=2),
        "zscore_clip",
        "std",
    ),
    "clip_by_value": (lambda: clipjax.clip_by_value(0.1), "clip_by_value", "clipped_fraction"),
    "clip_by_percentile": (
        lambda: clipjax.clip_by_percentile(90.0),
        "clip_by_percentile",
        "bound",
    ),
    "normalize_per_param": (
        lambda: clipjax.normalize_per_param(),
        "normalize_per_param",
        "grad_norm",
    ),
    "zscore_normalize": (lambda: clipjax.zscore_normalize(), "zscore_normalize", "grad_norm"),
}
for _key, _value in OPTIONAL.items():
    if hasattr(clipjax, _value[1]):
        TRANSFORMS[_key] = _value

IDS = sorted(TRANSFORMS)
# What this file checks: the clippers and the optimizers.
ALL = {**TRANSFORMS, **OPTIMIZERS}
ALL_IDS = sorted(ALL)


def make_params(dtype: Any = jnp.float32) -> Any:
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "params": {
            "Dense_0": {
                "kernel": jax.random.normal(k1, (6, 5), dtype),
                "bias": jnp.zeros((5,), dtype),
            },
            "Dense_1": {"kernel": jax.random.normal(k2, (5, 3), dtype), "bias": None},
            "scale": jax.random.normal(k3, (3,), dtype),
        }
    }


def grads_at(params: Any, step: int) -> Any:
    factor = 1.0 + 0.1 * np.sin(step) + (30.0 if step == 6 else 0.0)
    return jax.tree.map(lambda p: (p * factor + 0.01).astype(p.dtype), params)


@pytest.fixture(params=ALL_IDS)
def case(request: Any) -> tuple[Factory, str, str]:
    return ALL[request.param]


class TestContractWithAndWithoutJit(chex.TestCase):
    """init/update of every transform, eagerly and under ``jit`` (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((name, name) for name in ALL_IDS))
    def test_state_is_stable_and_dtypes_kept(self, name: str) -> None:
        tx = ALL[name][0]()
        params = make_params()
        first = tx.init(params)
        state = first
        update = self.variant(tx.update)
        for step in range(8):
            grads = grads_at(params, step)
            out, state = update(grads, state, params)
            chex.assert_trees_all_equal_structs(state, first)
            chex.assert_trees_all_equal_shapes_and_dtypes(state, first)
            chex.assert_trees_all_equal_shapes_and_dtypes(out, grads)
        chex.assert_tree_all_finite(out)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        *(
            (f"{name}_{jnp.dtype(dtype).name}", name, dtype)
            for name in ALL_IDS
            for dtype in (jnp.bfloat16, jnp.float16)
        )
    )
    def test_low_precision_leaves_keep_dtype(self, name: str, dtype: Any) -> None:
        tx = ALL[name][0]()
        params = make_params(dtype)
        state = tx.init(params)
        out, state = self.variant(tx.update)(grads_at(params, 1), state, params)
        chex.assert_trees_all_equal_dtypes(out, params)
        norms = {k: v for k, v in clipjax.metrics(state).items() if k.endswith("/grad_norm")}
        if name in NORMLESS:
            norms = clipjax.metrics(state)
        self.assertTrue(norms)
        chex.assert_tree_all_finite(norms)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((name, name) for name in ALL_IDS))
    def test_two_of_a_kind_get_distinct_names(self, name: str) -> None:
        make, prefix, _ = ALL[name]
        params = make_params()
        tx = optax.chain(make(), make(), optax.sgd(0.1))
        state = tx.init(params)
        _, state = self.variant(tx.update)(grads_at(params, 0), state, params)
        names = {k.split("/")[0] for k in clipjax.metrics(state)}
        self.assertLessEqual({prefix, prefix + "_1"}, names)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((name, name) for name in ALL_IDS))
    def test_empty_tree(self, name: str) -> None:
        tx = ALL[name][0]()
        state = tx.init({})
        out, new_state = self.variant(tx.update)({}, state, {})
        self.assertEqual(out, {})
        chex.assert_trees_all_equal_structs(new_state, state)
        chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)


def test_scan_carry_and_single_trace(case: Any) -> None:
    make, _, _ = case
    tx = make()
    params = make_params()
    traces = []

    def step(state: Any, i: jax.Array) -> Any:
        traces.append(1)
        grads = jax.tree.map(lambda p: p * (1.0 + 0.01 * i.astype(p.dtype)), params)
        _, state = tx.update(grads, state, params)
        return state, None

    state, _ = jax.lax.scan(step, tx.init(params), jnp.arange(12.0))
    assert len(traces) == 1
    chex.assert_trees_all_equal_structs(state, tx.init(params))
    chex.assert_trees_all_equal_shapes_and_dtypes(state, tx.init(params))

    jitted = jax.jit(tx.update)
    state = tx.init(params)
    for i in range(5):
        _, state = jitted(grads_at(params, i), state, params)
    assert jitted._cache_size() == 1


def test_state_can_be_donated(case: Any) -> None:
    make, _, _ = case
    tx = make()
    params = make_params()
    update = jax.jit(tx.update, donate_argnums=(1,))
    state = tx.init(params)
    for i in range(3):
        _, state = update(grads_at(params, i), state, params)
    jax.block_until_ready(state)


def test_no_host_transfer_inside_update(case: Any) -> None:
    make, _, _ = case
    tx = make()
    params = make_params()
    state = tx.init(params)
    grads = grads_at(params, 0)
    update = jax.jit(tx.update)
    update(grads, state, params)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        _, state = update(grads, state, params)
        jax.block_until_ready(state)


def _wrappers(make: Factory) -> dict[str, optax.GradientTransformation]:
    def mask_fn(params: Any) -> Any:
        return jax.tree.map(lambda _: True, params)

    labels = lambda params: jax.tree.map(lambda _: "a", params)
    return {
        "chain": optax.chain(make(), optax.sgd(0.1)),
        "named_chain": optax.named_chain(("clip", make()), ("sgd", optax.sgd(0.1))),
        "multisteps": optax.MultiSteps(optax.chain(make(), optax.sgd(0.1)), 2),
        "masked": optax.masked(make(), mask_fn),
        "partition": optax.partition({"a": make()}, labels),
        "apply_if_finite": optax.apply_if_finite(optax.chain(make(), optax.sgd(0.1)), 3),
        "inject": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
    }


def test_metrics_found_in_every_wrapper(case: Any) -> None:
    make, prefix, field = case
    params = make_params()
    for label, tx in _wrappers(make).items():
        if label == "inject":
            tx = optax.chain(make(), tx)
        state = tx.init(params)
        update = jax.jit(tx.update)
        for i in range(3):
            _, state = update(grads_at(params, i), state, params)
        found = clipjax.metrics(state)
        keys = [k for k in found if k.startswith(prefix + "/") and k.endswith("/" + field)]
        assert keys, (label, sorted(found)[:5])
        assert all(jnp.shape(found[k]) == () for k in keys)
        inside = jax.jit(clipjax.metrics)(state)
        assert set(inside) == set(found)


def test_update_with_another_tree_fails_clearly(case: Any) -> None:
    make, _, _ = case
    tx = make()
    params = make_params()
    state = tx.init(params)
    other = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="does not match"):
        tx.update(other, state, other)

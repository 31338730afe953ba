"""agc: unitwise equals optax.adaptive_grad_clip (with its ``axis=`` too); grouped equals
smartclip's AGC."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import references as R
from tests.conftest import version_of


def tree(seed: int = 0, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"dense": (6, 5), "mha": (4, 3, 2), "conv": (3, 3, 2, 4), "conv3d": (2, 2, 2, 3, 2)}
    shapes |= {"bias": (5,), "column": (1, 7), "scalar": ()}
    return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in shapes.items()}


@pytest.mark.skipif(
    version_of(optax) < (0, 2, 6), reason="optax.adaptive_grad_clip takes 5-D leaves from 0.2.6"
)
@pytest.mark.parametrize("clipping", [0.001, 0.05, 1.0])
def test_unitwise_equals_optax(clipping: float) -> None:
    params, grads = tree(0), tree(1, scale=0.2)
    tx = clipjax.agc(clipping)
    out, state = jax.jit(tx.update)(grads, tx.init(params), params)
    want, _ = optax.adaptive_grad_clip(clipping).update(grads, None, params)
    for k in grads:
        np.testing.assert_allclose(out[k], want[k], rtol=1e-6, atol=1e-9, err_msg=k)
    m = clipjax.metrics(state)
    assert 0 < float(m["agc/conv/scale"]) <= 1
    np.testing.assert_allclose(
        float(m["agc/dense/weight_norm"]), np.linalg.norm(np.asarray(params["dense"])), rtol=1e-6
    )


def test_unitwise_metrics_describe_units() -> None:
    params = {"w": jnp.ones((4, 3))}
    grads = {"w": jnp.asarray([[1.0, 0.001, 1.0]] * 4)}
    tx = clipjax.agc(0.1)
    _, state = tx.update(grads, tx.init(params), params)
    m = clipjax.metrics(state)
    np.testing.assert_allclose(float(m["agc/w/clipped_fraction"]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(m["agc/w/scale"]), 0.1 * 2 / 2, rtol=1e-6)
    assert bool(m["agc/w/clipped"])


def restated_grouped(g: float, w: float, clipping: float, eps: float) -> float:
    target = max(eps, clipping * (w + eps))
    return min(1.0, target / (g + eps))


@pytest.mark.parametrize("scope", ["global", "per_layer", "per_param"])
def test_grouped_equals_float64_restatement(scope: str) -> None:
    def layers(s: int, c: int) -> dict:
        return {"a": {"w": tree(s)["dense"], "b": tree(s)["bias"]}, "c": {"w": tree(c)["conv"]}}

    params, grads = layers(0, 2), jax.tree.map(lambda x: x * 0.3, layers(3, 4))
    tx = clipjax.agc(0.02, eps=1e-3, scope=scope)
    out, state = tx.update(grads, tx.init(params), params)
    m = clipjax.metrics(state)
    groups = {
        "global": {"global": [("a", "w"), ("a", "b"), ("c", "w")]},
        "per_layer": {"a": [("a", "w"), ("a", "b")], "c": [("c", "w")]},
        "per_param": {"a/w": [("a", "w")], "a/b": [("a", "b")], "c/w": [("c", "w")]},
    }[scope]
    for name, members in groups.items():
        g = np.sqrt(sum(np.sum(np.asarray(grads[a][b], np.float64) ** 2) for a, b in members))
        w = np.sqrt(sum(np.sum(np.asarray(params[a][b], np.float64) ** 2) for a, b in members))
        scale = restated_grouped(g, w, 0.02, 1e-3)
        np.testing.assert_allclose(float(m[f"agc/{name}/scale"]), scale, rtol=2e-6)
        np.testing.assert_allclose(
            float(m[f"agc/{name}/target"]), max(1e-3, 0.02 * (w + 1e-3)), rtol=2e-6
        )
        for a, b in members:
            np.testing.assert_allclose(out[a][b], np.asarray(grads[a][b]) * scale, rtol=3e-6)


@pytest.mark.skipif(not R.have_smartclip(), reason="smartclip not installed")
def test_grouped_scale_equals_smartclip_core() -> None:
    import smartclip

    ref = smartclip.AGC(clipping=0.01, eps=1e-3, scope="global", exclude_bias_bn=False)
    rng = np.random.default_rng(0)
    for _ in range(20):
        params = {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)}
        grads = {"w": jnp.asarray(rng.normal(size=(8, 8)) * rng.uniform(0.001, 1), jnp.float32)}
        tx = clipjax.agc(0.01, eps=1e-3, scope="global")
        _, state = tx.update(grads, tx.init(params), params)
        m = clipjax.metrics(state)
        g, w = float(m["agc/global/grad_norm"]), float(m["agc/global/weight_norm"])
        np.testing.assert_allclose(float(m["agc/global/scale"]), ref.scale(g, w), rtol=1e-6)
        np.testing.assert_allclose(float(m["agc/global/target"]), ref.target_norm(w), rtol=1e-6)


@pytest.mark.parametrize("scope", ["unitwise", "global", "per_param"])
def test_exclude_bias_bn(scope: str) -> None:
    params = {"kernel": jnp.ones((4, 4)), "bias": jnp.full((4,), 0.01)}
    grads = {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,))}
    tx = clipjax.agc(0.01, scope=scope, exclude_bias_bn=True)
    out, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(out["bias"], grads["bias"])
    assert float(jnp.max(out["kernel"])) < 1.0
    m = clipjax.metrics(state)
    if scope == "global":
        np.testing.assert_allclose(float(m["agc/global/grad_norm"]), 4.0, rtol=1e-6)
    if scope == "unitwise":
        # The excluded leaf's metrics say it was left alone; the kernel's say it was clipped.
        assert float(m["agc/bias/scale"]) == 1.0 and not bool(m["agc/bias/clipped"])
        assert float(m["agc/bias/clipped_fraction"]) == 0.0
        assert float(m["agc/kernel/scale"]) < 1.0 and bool(m["agc/kernel/clipped"])


@pytest.mark.parametrize("scope", ["unitwise", "per_layer"])
def test_missing_params_is_a_clear_error(scope: str) -> None:
    tx = clipjax.agc(scope=scope)
    g = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(g, tx.init(g))


def test_nonfinite_gradient_passes_and_is_counted() -> None:
    params = {"w": jnp.ones((3, 2))}
    grads = {"w": jnp.array([[jnp.nan, 1.0], [1.0, 1.0], [1.0, 1.0]])}
    for scope, group in [("unitwise", "w"), ("global", "global")]:
        tx = clipjax.agc(0.01, scope=scope)
        out, state = tx.update(grads, tx.init(params), params)
        assert int(clipjax.metrics(state)[f"agc/{group}/nonfinite_count"]) == 1
        assert float(out["w"][1, 0 if scope == "global" else 1]) <= 1.0


@pytest.mark.parametrize("kwargs", [{"clipping": 0.0}, {"eps": -1.0}, {"scope": "x"}])
def test_invalid_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        clipjax.agc(**kwargs)


def test_unitwise_axis_name_gives_every_replica_the_same_scale() -> None:
    params = {"w": jnp.ones((4, 3))}
    base = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    factors = jnp.array([0.5, 2.0])
    tx = clipjax.agc(0.05, axis_name="i")
    state = tx.init(params)

    def step(c):
        out, new_state = tx.update({"w": base * c}, state, params)
        return out["w"] / c, clipjax.metrics(new_state)["agc/w/scale"]

    out, scale = jax.vmap(step, axis_name="i")(factors)
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6)
    assert scale[0] == scale[1]
    want, _ = optax.adaptive_grad_clip(0.05).update({"w": base * 1.25}, None, params)
    np.testing.assert_allclose(out[0] * 1.25, want["w"], rtol=1e-6)


@pytest.mark.parametrize("axis", [None, 0, (0, 1), -1], ids=str)
@pytest.mark.skipif(
    version_of(optax) < (0, 2, 6), reason="optax.adaptive_grad_clip has axis= from optax 0.2.6"
)
def test_agc_axis_matches_optax(axis: Any) -> None:
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    shapes = {"d2": (6, 5), "d3": (4, 3, 5), "d4": (3, 3, 4, 5)}
    params = {n: jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys[:3])}
    # Log-normal spread of the elements: for every axis some units clip, some do not.
    grads = {
        n: 0.002 * jax.random.normal(k, s) * jnp.exp(3 * jax.random.normal(k, s))
        for (n, s), k in zip(shapes.items(), keys[3:])
    }
    ref_tx = optax.adaptive_grad_clip(0.05, 1e-3, axis=axis)
    ref, _ = ref_tx.update(grads, ref_tx.init(params), params)
    changed = np.mean([float(jnp.mean(ref[n] != grads[n])) for n in shapes])
    assert 0.1 < changed < 0.9, "the comparison must cover clipped and kept units"
    tx = clipjax.agc(0.05, 1e-3, scope="unitwise", axis=axis)
    out, state = jax.jit(tx.update)(grads, tx.init(params), params)
    for name in shapes:
        np.testing.assert_allclose(out[name], ref[name], rtol=2e-6, atol=1e-8, err_msg=name)
    assert any(k.startswith("agc/") for k in clipjax.metrics(state))

"""``leaf_norms=True`` records each leaf's pre-clip L2 norm (``{prefix}/leaf/{path}/grad_norm``)
at no second pass over the gradients; ``metrics(flat=False)`` is the flat view, nested."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import ordinary_path
from tests.model import mlp_params
from tests.registry import CASES, CLIPPER_IDS, fan_out

# Every clipper with a scope (CONTRACT "diagnostics"): the training clippers, and adagc.
LEAF_IDS = sorted([*CLIPPER_IDS, "adagc"])


def _leaf_norms64(tree: Any) -> dict[str, float]:
    norm = lambda x: float(np.linalg.norm(np.asarray(x, np.float64).ravel()))
    return {clipjax.path_name(p): norm(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _leaf_metrics(values: dict[str, jax.Array], prefix: str) -> dict[str, float]:
    head, tail = f"{prefix}/leaf/", "/grad_norm"
    keys = [k for k in values if k.startswith(head) and k.endswith(tail)]
    return {k[len(head) : -len(tail)]: float(values[k]) for k in keys}


@pytest.mark.parametrize("case", LEAF_IDS)
def test_leaf_norms_are_the_pre_clip_leaf_norms(case: str, make_grad_stream: Any) -> None:
    spec = CASES[case]
    params = mlp_params()
    assert not _leaf_metrics(clipjax.metrics(spec.make().init(params)), spec.algo)
    tx = spec.make(leaf_norms=True)
    state = tx.init(params)
    update = jax.jit(tx.update)
    # Large gradients (every clipper clips some of them) and a spike at step 3.
    clipped = False
    for grads in make_grad_stream(params, 5, seed=4, spikes={3: 50.0}):
        grads = jax.tree.map(lambda g: 5.0 * g, grads)
        out, state = update(grads, state, params)
        changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), out, grads)
        clipped = clipped or any(jax.tree.leaves(changed))
        got = _leaf_metrics(clipjax.metrics(state), spec.algo)
        expected = _leaf_norms64(grads)
        assert set(got) == set(expected), (sorted(got), sorted(expected))
        for path, norm in expected.items():
            np.testing.assert_allclose(got[path], norm, rtol=1e-5, err_msg=path)
    if spec.algo not in ("autoclip", "zscore_clip"):  # observe-first: may never clip here
        assert clipped, "some step must be clipped, so that pre- and post-clip norms differ"

    # A NaN in one leaf: that leaf's norm is non-finite, the others are exact.
    bad = "params/Dense_0/kernel"
    grads = jax.tree.map(lambda g: 5.0 * g, next(make_grad_stream(params, 1, seed=9)))
    kernel = grads["params"]["Dense_0"]["kernel"]
    grads["params"]["Dense_0"]["kernel"] = kernel.at[0, 0].set(jnp.nan)
    _, state = update(grads, state, params)
    got = _leaf_metrics(clipjax.metrics(state), spec.algo)
    expected = _leaf_norms64(grads)
    assert not np.isfinite(got[bad])
    for path, norm in expected.items():
        if path != bad:
            np.testing.assert_allclose(got[path], norm, rtol=1e-5, err_msg=path)


def _wide_params(layers: int = 4, width: int = 64) -> Any:
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    return {
        "params": {
            f"Dense_{i}": {
                "kernel": jax.random.normal(k, (width, width)) / np.sqrt(width),
                "bias": jnp.full((width,), 0.1),
            }
            for i, k in enumerate(keys)
        }
    }


def _bytes_accessed(clipper: optax.GradientTransformation, params: Any) -> float:
    """Bytes accessed by one ``chain(clipper, adam)`` update."""
    tx = optax.chain(clipper, optax.adam(1e-3))
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    cost = jax.jit(tx.update).lower(grads, tx.init(params), params).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost["bytes accessed"])


@pytest.mark.parametrize("case", LEAF_IDS)
def test_leaf_norms_cost_no_second_pass(case: str) -> None:
    spec = CASES[case]
    params = _wide_params()
    with ordinary_path():  # the overflow recompute's branch is not a pass an ordinary step runs
        base = _bytes_accessed(spec.make(), params)
        with_norms = _bytes_accessed(spec.make(leaf_norms=True), params)
    grads_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    allowed = 64 * len(jax.tree.leaves(params)) + 0.01 * base
    assert allowed < grads_bytes / 4, "the bound must catch one more read of the gradients"
    assert with_norms - base <= allowed, (
        f"leaf_norms=True adds {with_norms - base:.0f} bytes accessed to {base:.0f} "
        f"(allowed {allowed:.0f}; the gradients are {grads_bytes} bytes)"
    )


def _flatten(nested: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(nested, dict):
        return {prefix: nested}
    out: dict[str, Any] = {}
    for key, value in nested.items():
        out.update(_flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


def _run(tx: optax.GradientTransformation, steps: int = 5) -> Any:
    params = mlp_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(steps):
        grads = jax.tree.map(lambda p, f=1.0 + 0.1 * i: p * f + 0.01, params)
        _, state = update(grads, state, params)
    return state


def test_nested_metrics_are_the_flat_metrics_nested() -> None:
    tx = optax.chain(clipjax.zclip(warmup_steps=2, scope="per_layer"), optax.adam(1e-3))
    state = _run(tx)
    flat = clipjax.metrics(state)
    nested = clipjax.metrics(state, flat=False)
    groups = ("params/Dense_0", "params/Dense_1")
    assert set(nested) == {"zclip"} and tuple(nested["zclip"]) == groups
    for group in groups:
        fields = {k.split("/")[-1] for k in flat if k.startswith(f"zclip/{group}/")}
        assert set(nested["zclip"][group]) == fields
        for field in fields:
            np.testing.assert_array_equal(
                nested["zclip"][group][field], flat[f"zclip/{group}/{field}"]
            )
    assert jax.tree.structure(jax.jit(lambda s: clipjax.metrics(s, flat=False))(state)) == (
        jax.tree.structure(nested)
    )


def test_nested_metrics_every_clipper_with_leaf_norms() -> None:
    transforms = {n: CASES[n].make(name=n, leaf_norms=True) for n in LEAF_IDS}
    state = _run(optax.chain(fan_out(transforms), optax.sgd(0.1)))
    flat = clipjax.metrics(state)
    nested = clipjax.metrics(state, flat=False)
    joined = _flatten(nested)
    assert set(joined) == set(flat)
    for key, value in flat.items():
        np.testing.assert_array_equal(joined[key], value, err_msg=key)
    for name in LEAF_IDS:
        leaves = nested[name]["leaf"]
        assert set(leaves) == set(_leaf_norms64(mlp_params())), name
        for path, fields in leaves.items():
            assert set(fields) == {"grad_norm"}
            np.testing.assert_array_equal(
                fields["grad_norm"], flat[f"{name}/leaf/{path}/grad_norm"]
            )

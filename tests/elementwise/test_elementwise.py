"""clip_by_value, clip_by_percentile and the per-leaf normalisers (SPEC 4.6) against a float64
NumPy restatement of each formula and their references (``optax.clip``; drytorch's
``GradParamNormalizer`` and ``GradZScoreNormalizer``, skipped with a reason without torch)."""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clipjax import (
    ClipByPercentileState,
    ClipByValueState,
    NormalizePerParamState,
    ZScoreNormalizeState,
    _percentile,
    clip_by_percentile,
    clip_by_value,
    metrics,
    normalize_per_param,
    zscore_normalize,
)

LOW_PRECISION = (jnp.bfloat16, jnp.float16, jnp.float32)
LAYERS = {"params": ["w", "b", "one"], "params/layer": ["kernel", "bias"]}  # per_layer groups


def mixed_dtypes(tree: Any) -> Any:
    """The leaves of ``tree`` cast in turn to bfloat16, float16 and float32."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x.astype(LOW_PRECISION[i % 3]) for i, x in enumerate(leaves)]
    )


def grads_tree(seed: int = 0, dtype: Any = jnp.float32) -> Any:
    rng = np.random.default_rng(seed)
    n = rng.standard_normal
    w, b, kernel, bias, one = n((6, 5)) * 3.0, rng.standard_cauchy(5), n((4, 3)), n(3), n(1)
    tree = {"params": {"w": w, "b": b, "layer": {"kernel": kernel, "bias": bias}, "one": one}}
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def paths(tree: Any) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(x)
            for path, x in flat}  # fmt: skip


def layer_values(grads: Any, group: str) -> np.ndarray:
    """The elements of one per_layer group, float64."""
    return np.concatenate([paths(grads)[f"{group}/{k}"].reshape(-1) for k in LAYERS[group]])


def signature(tree: Any) -> Any:
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def run(tx: optax.GradientTransformation, grads: Any, steps: int = 1) -> tuple[Any, Any]:
    """``steps`` jitted updates on ``grads``; the state keeps its structure, shapes and dtypes."""
    state = tx.init(grads)
    update = jax.jit(tx.update)
    for _ in range(steps):
        out, new_state = update(grads, state)
        assert signature(new_state) == signature(state)
        state = new_state
    return out, state


def max_abs(x: Any) -> float:
    return float(jnp.max(jnp.abs(x)))


def test_clip_by_value_equals_optax_clip() -> None:
    grads = mixed_dtypes(grads_tree(1))
    w = grads["params"]["w"]
    grads["params"]["w"] = w.at[0, 0].set(jnp.inf).at[1, 1].set(-jnp.inf).at[2, 2].set(jnp.nan)
    assert {x.dtype for x in jax.tree.leaves(grads)} == set(map(jnp.dtype, LOW_PRECISION))
    out, state = run(clip_by_value(0.7), grads)
    expected, _ = optax.clip(0.7).update(grads, optax.clip(0.7).init(grads))
    for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        assert o.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(e, np.float32))
    m = metrics(state)
    assert int(m["clip_by_value/global/nonfinite_count"]) == 1
    assert int(m["clip_by_value/global/count"]) == 0


def test_clip_by_value_metrics_per_group_and_negative_bound() -> None:
    grads = grads_tree(2)
    out, state = run(clip_by_value(-1.5, scope="per_layer"), grads, steps=3)
    m = metrics(state)
    for name, x in paths(grads).items():
        np.testing.assert_array_equal(paths(out)[name], np.clip(x, -1.5, 1.5))
    for group in LAYERS:
        values = layer_values(grads, group)
        fraction = np.mean(np.abs(values.astype(np.float64)) > 1.5)
        at = lambda field, group=group: m[f"clip_by_value/{group}/{field}"]
        np.testing.assert_allclose(float(at("clipped_fraction")), fraction, rtol=1e-6)
        np.testing.assert_allclose(float(at("grad_norm")), np.linalg.norm(values), rtol=1e-6)
        assert bool(at("clipped")) == (fraction > 0)
        assert int(at("step")) == 3 and int(at("count")) == 3
        assert int(at("clipped_count")) == 3 * (fraction > 0)


def test_clip_by_value_inject_hyperparams() -> None:
    tx = optax.inject_hyperparams(clip_by_value)(max_abs=0.5)
    grads = grads_tree(3)
    update = jax.jit(tx.update)
    out, state = update(grads, tx.init(grads))
    assert max_abs(out["params"]["w"]) == 0.5
    state.hyperparams["max_abs"] = jnp.asarray(0.25)
    out, state = update(grads, state)
    assert max_abs(out["params"]["w"]) == 0.25
    assert int(metrics(state)["clip_by_value/global/step"]) == 2


@pytest.mark.parametrize(
    "scope,p",
    [("per_param", 10.0), ("per_param", 95.0), ("per_param", 100.0), ("per_layer", 50.0),
     ("global", 5.0), ("global", 99.0)],
)  # fmt: skip
def test_clip_by_percentile_exact_matches_numpy(scope: str, p: float) -> None:
    """The bound is np.percentile of |g| over each group's elements (float64)."""
    grads = grads_tree(4)
    leaves = {k: v.astype(np.float64) for k, v in paths(grads).items()}
    if scope == "per_param":
        groups = {k: [v] for k, v in leaves.items()}
    elif scope == "per_layer":
        groups = {g: [leaves[f"{g}/{k}"] for k in ks] for g, ks in LAYERS.items()}
    else:
        groups = {"global": list(leaves.values())}
    values = {g: np.concatenate([x.reshape(-1) for x in xs]) for g, xs in groups.items()}
    bounds = {g: float(np.percentile(np.abs(v), p)) for g, v in values.items()}
    out, state = run(clip_by_percentile(p, scope=scope, method="exact"), grads)
    m = metrics(state)
    for group, bound in bounds.items():
        np.testing.assert_allclose(float(m[f"clip_by_percentile/{group}/bound"]), bound, rtol=3e-7)
        fraction = np.mean(np.abs(values[group]) > np.float32(bound))
        np.testing.assert_allclose(
            float(m[f"clip_by_percentile/{group}/clipped_fraction"]), fraction, atol=1e-7
        )
    for name, x in leaves.items():
        b = bounds[{"per_param": name, "global": "global"}.get(scope, name.rsplit("/", 1)[0])]
        np.testing.assert_allclose(paths(out)[name], np.clip(x, -b, b), rtol=3e-7, atol=0)


def test_clip_by_percentile_metric_names() -> None:
    _, state = run(clip_by_percentile(90.0), {"params": {"w": jnp.arange(-5.0, 5.0), "b": None}})
    m = metrics(state)
    fields = "grad_norm bound clipped_fraction clipped count step clipped_count nonfinite_count"
    assert set(m) == {f"clip_by_percentile/params/w/{f}" for f in fields.split()}
    np.testing.assert_allclose(float(m["clip_by_percentile/params/w/bound"]), 4.1, rtol=1e-6)
    np.testing.assert_allclose(float(m["clip_by_percentile/params/w/clipped_fraction"]), 0.1)
    assert optax.tree_utils.tree_get(state, "ClipByPercentileState") is state


@pytest.mark.parametrize("scope", ["per_param", "global"])
def test_clip_by_percentile_approx_and_auto(scope: str) -> None:
    rng = np.random.default_rng(5)
    # embed is larger than the auto method's size.
    grads = {"params": {"embed": jnp.asarray(rng.standard_cauchy((300, 20)), jnp.float32),
                        "w": jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)}}  # fmt: skip
    eps = _percentile.approx_relative_error()
    e, a = (metrics(run(clip_by_percentile(99.0, scope=scope, method=m), grads)[1])
            for m in ("exact", "approx"))  # fmt: skip
    out, auto = run(clip_by_percentile(99.0, scope=scope), grads)
    u = metrics(auto)
    bounds = [key for key in e if key.endswith("/bound")]
    for key in bounds:
        ref = float(e[key])
        assert abs(float(a[key]) - ref) <= eps * ref + 4 * np.spacing(np.float32(ref))
        # Only the 6000-element embedding (and the global union) exceed the auto size.
        large = scope == "global" or "embed" in key
        assert float(u[key]) == float((a if large else e)[key]), key
    if scope == "global":
        assert float(a[bounds[0]]) != float(e[bounds[0]])  # the switch is visible
    key = "params/embed" if scope == "per_param" else "global"
    assert max_abs(out["params"]["embed"]) <= float(u[f"clip_by_percentile/{key}/bound"])


def test_clip_by_percentile_inject_hyperparams() -> None:
    grads = grads_tree(7)
    tx = optax.inject_hyperparams(clip_by_percentile, static_args=("scope", "method"))(
        percentile=50.0, scope="global"
    )
    update = jax.jit(tx.update)
    _, state = update(grads, tx.init(grads))
    low = float(metrics(state)["clip_by_percentile/global/bound"])
    state.hyperparams["percentile"] = jnp.asarray(90.0)
    _, state = update(grads, state)
    high = float(metrics(state)["clip_by_percentile/global/bound"])
    values = np.abs(np.concatenate([x.reshape(-1) for x in paths(grads).values()]))
    np.testing.assert_allclose([low, high], np.percentile(values, [50.0, 90.0]), rtol=1e-5)


@functools.cache
def percentile_clipper(method: str) -> Any:
    """A jitted ``(values, percentile) -> (clipped, bound)``, percentile injected."""
    tx = optax.inject_hyperparams(clip_by_percentile, static_args=("scope", "method"))(
        percentile=50.0, method=method
    )

    def clip(values: jax.Array, percentile: jax.Array) -> tuple[jax.Array, jax.Array]:
        state = tx.init({"g": values})
        state.hyperparams["percentile"] = percentile
        out, state = tx.update({"g": values}, state)
        return out["g"], metrics(state)["clip_by_percentile/g/bound"]

    return jax.jit(clip)


@given(
    st.sampled_from([1, 2, 17, 300]).flatmap(
        lambda n: hnp.arrays(
            np.float32, n, elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False)
        )
    ),
    st.floats(0.5, 100.0),
    st.sampled_from(["exact", "approx"]),
)
def test_clip_by_percentile_property(values: np.ndarray, p: float, method: str) -> None:
    out, bound = percentile_clipper(method)(jnp.asarray(values), jnp.float32(p))
    out, bound = np.asarray(out), np.float32(bound)
    assert np.max(np.abs(out)) <= bound
    keep = np.abs(values) <= bound
    np.testing.assert_array_equal(out[keep], values[keep])
    np.testing.assert_array_equal(np.abs(out[~keep]), bound)
    assert np.all(out[~keep] * values[~keep] >= 0)  # same sign (or 0 when bound is 0)
    # The bound is the percentile (float32 rank under injection, see _percentile).
    exact = np.percentile(np.abs(values.astype(np.float64)), p)
    assert abs(bound - exact) <= 1e-5 * exact + 1e-5 * np.max(np.abs(values))


def numpy_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (np.linalg.norm(x) + eps)


def numpy_zscore(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    if x.size == 1:
        return np.zeros_like(x)  # FIX: drytorch gives NaN.
    return (x - x.mean()) / (x.std(ddof=1) + eps)


@pytest.mark.parametrize(
    "factory,restated", [(normalize_per_param, numpy_normalize), (zscore_normalize, numpy_zscore)]
)
def test_normalisers_match_numpy(factory: Any, restated: Any) -> None:
    grads = grads_tree(8)
    grads["params"]["shifted"] = jnp.asarray(np.random.default_rng(0).normal(1e3, 1e-2, 500))
    algo = factory.__name__
    for eps in (1e-8, 0.5):
        out, state = run(factory(eps), grads)
        m = metrics(state)
        for name, x in paths(grads).items():
            np.testing.assert_allclose(paths(out)[name], restated(x, eps), rtol=2e-5, atol=2e-6)
            norm = np.linalg.norm(x.astype(np.float64))
            np.testing.assert_allclose(float(m[f"{algo}/{name}/grad_norm"]), norm, rtol=1e-6)
            assert int(m[f"{algo}/{name}/count"]) == 1
        assert not any(k.endswith("clipped_count") for k in m)


def drytorch_apply(kind: str, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("drytorch") is None:
        pytest.skip("torch and drytorch are needed for the drytorch reference")
    import torch
    from drytorch.lib import gradient_ops

    op = {"param": gradient_ops.GradParamNormalizer, "zscore": gradient_ops.GradZScoreNormalizer}
    tensors = {}
    for name, g in grads.items():
        tensors[name] = torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float32))
        tensors[name].grad = torch.tensor(g, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the std of one element
        op[kind]()(list(tensors.values()))
    return {name: p.grad.numpy() for name, p in tensors.items()}


@pytest.mark.parametrize("kind", ["param", "zscore"])
def test_normalisers_match_drytorch(kind: str) -> None:
    grads = grads_tree(9)
    as_numpy = paths(grads)
    reference = drytorch_apply(kind, as_numpy)
    got = paths(run(normalize_per_param() if kind == "param" else zscore_normalize(), grads)[0])
    for name in as_numpy:
        if as_numpy[name].size == 1 and kind == "zscore":
            # FIX: drytorch's ddof=1 std of one element is NaN, and so is its output.
            assert np.isnan(reference[name]).all()
            np.testing.assert_array_equal(got[name], np.zeros(1, np.float32))
        else:
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6)


def test_zscore_one_element_fix_and_constant_leaf() -> None:
    grads = {"one": jnp.array([7.0]), "scalar": jnp.array(-2.0), "flat": jnp.full((4,), 3.0)}
    out, state = run(zscore_normalize(), grads)
    assert out["one"].tolist() == [0.0] and float(out["scalar"]) == 0.0
    assert out["flat"].tolist() == [0.0] * 4
    assert float(metrics(state)["zscore_normalize/one/grad_norm"]) == 7.0


@pytest.mark.parametrize("factory", [normalize_per_param, zscore_normalize])
def test_normalisers_pass_nonfinite_leaves_unchanged(factory: Any) -> None:
    grads = grads_tree(10)
    grads["params"]["w"] = grads["params"]["w"].at[1, 1].set(jnp.inf)
    out, state = run(factory(), grads)
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(grads["params"]["w"]))
    m = metrics(state)
    assert int(m[f"{factory.__name__}/params/w/nonfinite_count"]) == 1
    assert int(m[f"{factory.__name__}/params/w/count"]) == 0
    assert np.all(np.isfinite(np.asarray(out["params"]["b"])))


def test_clip_by_percentile_nonfinite_group_passes_unchanged() -> None:
    grads = grads_tree(6)
    grads["params"]["w"] = grads["params"]["w"].at[0, 0].set(jnp.nan)
    out, state = run(clip_by_percentile(50.0), grads)
    m = metrics(state)
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(grads["params"]["w"]))
    assert float(m["clip_by_percentile/params/w/bound"]) == np.inf
    assert int(m["clip_by_percentile/params/w/nonfinite_count"]) == 1
    assert int(m["clip_by_percentile/params/w/count"]) == 0
    assert not bool(m["clip_by_percentile/params/w/clipped"])
    assert int(m["clip_by_percentile/params/b/count"]) == 1  # other leaves clipped as usual
    assert max_abs(out["params"]["b"]) == float(m["clip_by_percentile/params/b/bound"])


@pytest.mark.parametrize("factory", [normalize_per_param, zscore_normalize])
def test_normalisers_inject_eps(factory: Any) -> None:
    grads = grads_tree(11)
    tx = optax.inject_hyperparams(factory)(eps=1e-8)
    update = jax.jit(tx.update)
    small, state = update(grads, tx.init(grads))
    state.hyperparams["eps"] = jnp.asarray(1e3)
    large, state = update(grads, state)
    assert max_abs(large["params"]["w"]) < max_abs(small["params"]["w"]) / 10


ALL = {
    "clip_by_value": (lambda: clip_by_value(0.5), ClipByValueState),
    "clip_by_percentile": (lambda: clip_by_percentile(90.0), ClipByPercentileState),
    "clip_by_percentile_global_approx": (
        lambda: clip_by_percentile(90.0, scope="global", method="approx"),
        ClipByPercentileState,
    ),
    "normalize_per_param": (lambda: normalize_per_param(), NormalizePerParamState),
    "zscore_normalize": (lambda: zscore_normalize(), ZScoreNormalizeState),
}


@pytest.mark.parametrize("case", sorted(ALL))
def test_dtype_kept_and_statistics_in_float32(case: str) -> None:
    make, state_class = ALL[case]
    # Magnitude 1e3: squares overflow float16, so this fails unless norms are float32.
    grads = mixed_dtypes(jax.tree.map(lambda x: x * 1e3, grads_tree(12)))
    out, state = run(make(), grads, steps=2)
    assert isinstance(state, state_class)
    for g, o in zip(jax.tree.leaves(grads), jax.tree.leaves(out)):
        assert o.dtype == g.dtype and o.shape == g.shape
        assert bool(jnp.all(jnp.isfinite(o)))
    for key, value in metrics(state).items():
        if key.endswith(("grad_norm", "bound", "clipped_fraction")):
            assert value.dtype == jnp.float32 and np.isfinite(float(value)), key


@pytest.mark.parametrize("case", sorted(ALL))
def test_float64_leaves(case: str, x64: None) -> None:
    out, state = run(ALL[case][0](), grads_tree(13, jnp.float64))
    assert all(o.dtype == jnp.float64 for o in jax.tree.leaves(out))
    norms = [v for k, v in metrics(state).items() if k.endswith("grad_norm")]
    assert norms and all(v.dtype == jnp.float64 for v in norms)


@pytest.mark.parametrize("case", sorted(ALL))
def test_none_leaves_empty_trees_and_wrong_tree(case: str) -> None:
    tx = ALL[case][0]()
    assert tx.update({}, tx.init({}))[0] == {}
    grads = {"a": jnp.ones((3,)), "skip": None}
    assert run(tx, grads)[0]["skip"] is None
    with pytest.raises(ValueError, match="does not match"):
        tx.update({"other": jnp.ones((2,))}, tx.init(grads))


def test_distinct_names_in_one_chain() -> None:
    tx = optax.chain(clip_by_value(1.0), clip_by_value(0.5), clip_by_percentile(90.0, name="p90"))
    _, state = run(tx, grads_tree(14))
    assert {k.split("/")[0] for k in metrics(state)} == {"clip_by_value", "clip_by_value_1", "p90"}


@pytest.mark.parametrize(
    "build,argument",
    [
        (lambda: clip_by_value(float("nan")), "max_abs"),
        (lambda: clip_by_value(1.0, scope="bogus"), "scope"),
        (lambda: clip_by_percentile(0.0), "percentile"),
        (lambda: clip_by_percentile(100.5), "percentile"),
        (lambda: clip_by_percentile(float("nan")), "percentile"),
        (lambda: clip_by_percentile(0.95), "percentile=0.95: percentiles are on the 0-100 scale"),
        (lambda: clip_by_percentile(1.0), "Pass percentile=100"),
        (lambda: clip_by_percentile(50.0, method="median"), "method"),
        (lambda: clip_by_percentile(50.0, scope="unitwise"), "scope"),
        (lambda: clip_by_percentile(50.0, name=""), "name"),
        (lambda: normalize_per_param(-1.0), "eps"),
        (lambda: zscore_normalize(float("nan")), "eps"),
    ],
)
def test_invalid_hyperparameters(build: Any, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        build()

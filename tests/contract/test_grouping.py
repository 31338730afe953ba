"""Groups, names and group norms against float64 NumPy; what the hot path compiles to."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _grouping


def tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "Dense_0": {"kernel": rng.normal(size=(3, 4)), "bias": rng.normal(size=(4,))},
            "layers": [{"w": rng.normal(size=(2,))}, {"w": rng.normal(size=(5,))}],
        },
        "top": rng.normal(size=(3,)),
        "skipped": None,
    }


def as_jax(t: dict, dtype=jnp.float32) -> dict:
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), t)


def test_names_per_scope() -> None:
    t = as_jax(tree())
    per_param = _grouping.make_grouping(t, "per_param")
    dense, layers = ("params/Dense_0/bias", "params/Dense_0/kernel"), "params/layers"
    assert per_param.names == (*dense, f"{layers}/0/w", f"{layers}/1/w", "top")
    per_layer = _grouping.make_grouping(t, "per_layer")
    assert per_layer.names == ("params/Dense_0", "params/layers/0", "params/layers/1", "root")
    assert _grouping.make_grouping(t, "global").names == ("global",)
    by_rank = _grouping.make_grouping(t, lambda path, leaf: f"rank{jnp.ndim(leaf)}")
    assert by_rank.names == ("rank1", "rank2")


def test_callable_scope_gets_key_path_and_leaf() -> None:
    seen = []
    _grouping.make_grouping(as_jax(tree()), lambda path, leaf: seen.append((path, leaf)) or "all")
    assert all(isinstance(p, tuple) for p, _ in seen)
    assert seen[0][0][0] == jax.tree_util.DictKey("params")


@pytest.mark.parametrize("scope", ["global", "per_param", "per_layer"])
@pytest.mark.parametrize("ord", [1.0, 2.0, 3.0, 0.5, float("inf")])
def test_group_norms_match_float64(scope: str, ord: float) -> None:
    t = tree()
    leaves, _, _ = _grouping.leaves_with_names(as_jax(t))
    grouping = _grouping.make_grouping(as_jax(t), scope)
    got = np.asarray(_grouping.group_norms(leaves, grouping, ord))
    flat = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)]
    for g, members in enumerate(grouping.members):
        values = np.concatenate([flat[i] for i in members])
        want = np.linalg.norm(values, ord=ord) if ord != 0.5 else np.sum(np.abs(values) ** 0.5) ** 2
        np.testing.assert_allclose(got[g], want, rtol=2e-6)


def test_float16_of_magnitude_1e3_does_not_overflow() -> None:
    g = {"w": jnp.full((1000,), 1e3, jnp.float16)}
    norm = clipjax.global_norm(g)
    assert norm.dtype == jnp.float32
    np.testing.assert_allclose(float(norm), 1e3 * np.sqrt(1000), rtol=1e-6)
    naive = jnp.sqrt(jnp.sum(g["w"] * g["w"]))
    assert not np.isfinite(float(naive)), "a float16 accumulation would overflow"


def test_bfloat16_norm_is_accurate() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(100_000,)).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    want = np.linalg.norm(np.asarray(xb, np.float64))
    np.testing.assert_allclose(float(clipjax.global_norm({"w": xb})), want, rtol=1e-5)


def test_complex_leaves_use_squared_modulus() -> None:
    z = jnp.array([3 + 4j, 1 - 1j], jnp.complex64)
    np.testing.assert_allclose(float(clipjax.global_norm({"z": z})), np.sqrt(25 + 2), rtol=1e-6)
    tx = clipjax.clip_by_global_norm(1.0)
    out, _ = tx.update({"z": z}, tx.init({"z": z}))
    assert out["z"].dtype == jnp.complex64
    np.testing.assert_allclose(
        np.abs(np.asarray(out["z"])).dot(np.abs(np.asarray(out["z"]))), 1.0, rtol=1e-5
    )


def test_float64_leaves_accumulate_in_float64(x64) -> None:
    g = {"w": jnp.asarray([1e-30, 3e-30], jnp.float64)}  # squares underflow float32
    assert clipjax.global_norm(g).dtype == jnp.float64
    np.testing.assert_allclose(float(clipjax.global_norm(g)), np.sqrt(10) * 1e-30, rtol=1e-12)


def test_none_and_masked_leaves_are_skipped() -> None:
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    tx = optax.masked(clipjax.clip_by_global_norm(1.0, name="clip"), {"a": True, "b": False})
    state = tx.init(params)
    out, state = tx.update({"a": jnp.full(3, 10.0), "b": jnp.full(2, 10.0)}, state, params)
    np.testing.assert_allclose(
        float(clipjax.metrics(state)["clip/global/grad_norm"]), np.sqrt(300), rtol=1e-6
    )
    np.testing.assert_array_equal(out["b"], 10.0)


def full_size_ops(hlo: str, shape: str) -> set[str]:
    """Opcodes of the instructions of ``shape`` inside the fusions that produce ``shape``."""
    bodies = dict(re.findall(r"^%(\S+) .*?\{\n(.*?)\n\}", hlo, flags=re.S | re.M))
    ops: set[str] = set()
    for line in hlo.splitlines():
        if f"f32[{shape}]" in line and "fusion(" in line:
            called = re.search(r"calls=%([\w.\-]+)", line).group(1)
            for inner in bodies[called].splitlines():
                if f"[{shape}]" in inner.split("=")[1][:40]:
                    ops.add(re.search(r"\] ?\{?[\d,]*\}? ?(\w[\w-]*)\(", inner).group(1))
    return ops


@pytest.mark.parametrize(
    "make",
    [lambda: clipjax.clip_by_global_norm(1.0), lambda: clipjax.zclip(), lambda: clipjax.autoclip()],
)
def test_scaling_is_one_multiply_without_select(make) -> None:
    """The hot path over full tensors is a multiply: no select, no divide."""
    params = {"w": jnp.ones((256, 256))}
    tx = make()
    hlo = jax.jit(tx.update).lower(params, tx.init(params)).compile().as_text()
    ops = full_size_ops(hlo, "256,256")
    assert "multiply" in ops and not ops & {"select", "divide"}, ops


def test_name_must_be_a_string() -> None:
    with pytest.raises(ValueError, match="name"):
        clipjax.zclip(name="")


def distinct_fusions(tx, params) -> int:
    """Distinct fused computations after compilation: what XLA generates code for."""
    tx = optax.chain(tx, optax.adam(1e-3))
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]))
    text = step.lower(params, state, params).compile().as_text()
    bodies = re.findall(r"^%fused[\w.\-]* .*?\{\n(.*?)\n\}", text, flags=re.S | re.M)
    normal = {re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}|stack_frame_id=\d+", "", b) for b in bodies}
    return len(normal)


@pytest.mark.parametrize("scope", ["per_param", "per_layer"])
def test_many_groups_compile_like_one(scope: str) -> None:
    """Per-leaf scales are indexed with runtime offsets: a grouping adds no distinct fusions."""
    params = {f"layer{i}": {"w": jnp.ones((8, 8)), "b": jnp.ones(8)} for i in range(60)}
    grouped = distinct_fusions(clipjax.zclip(scope=scope), params)
    single = distinct_fusions(clipjax.zclip(), params)
    assert grouped <= single + 4, (grouped, single)

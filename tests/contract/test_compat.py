"""Issue 12: clipjax behaves like optax wherever optax has an answer: tree_map_params on its
chains (an opt_state sharding on 8 fake devices too), every leaf kind optax accepts, with
optax's numbers; integer gradients refused (test_contract checks an init/update mismatch)."""

from __future__ import annotations

import textwrap
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import scripts
from tests.model import mlp_params
from tests.registry import CASES, CLIPPER_IDS, TRANSFORM_IDS


@pytest.mark.parametrize("case", TRANSFORM_IDS)
def test_tree_map_params_on_chain(case: str) -> None:
    params = mlp_params()
    tx = optax.chain(CASES[case].make(), optax.adam(1e-3))
    state = tx.init(params)
    mapped = optax.tree_utils.tree_map_params(
        tx, lambda p: ("P", p.shape), state, transform_non_params=lambda _: "N"
    )
    # The mapped tree is a prefix of the state (what jit's in/out_shardings take): a
    # multi-group clipper's per-leaf group indices come back as one entry (init on optax's
    # leafless placeholder cannot know how many leaves the real tree has).
    is_mapped = lambda x: isinstance(x, str) or (isinstance(x, tuple) and x[:1] == ("P",))
    paired = jax.tree.map(lambda m, s: m, mapped, state, is_leaf=is_mapped)
    assert jax.tree.leaves(paired, is_leaf=is_mapped)
    clip_leaves = jax.tree.leaves(mapped[0])  # no copy of the params: all non-params
    assert clip_leaves and all(x == "N" for x in clip_leaves)
    shapes = jax.tree.map(lambda p: ("P", p.shape), params)
    assert mapped[1][0].mu == shapes and mapped[1][0].nu == shapes  # adam's moments


_SHARDING_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import clipjax
    from tests.model import batches, loss_fn, mlp_params
    from tests.registry import CASES, CLIPPER_IDS

    assert jax.device_count() == 8, jax.device_count()
    mesh = Mesh(jax.devices(), ("x",))
    whole = NamedSharding(mesh, P())  # replicated

    spec = lambda p: NamedSharding(mesh, P("x") if p.shape[0] % 8 == 0 else P())
    params = mlp_params()
    param_sharding = jax.tree.map(spec, params)
    params = jax.device_put(params, param_sharding)
    batch = next(batches(1))
    failures = []
    for case in CLIPPER_IDS:
        try:
            tx = optax.chain(CASES[case].make(), optax.adam(1e-3))
            # The state's params-shaped subtrees take the params' sharding, every other
            # leaf (clipjax's [groups] arrays, adam's count) is replicated.
            abstract = jax.eval_shape(tx.init, params)
            sharding = optax.tree_utils.tree_map_params(
                tx, lambda _, s: s, abstract, param_sharding, transform_non_params=lambda _: whole
            )
            state = jax.jit(tx.init, out_shardings=sharding)(params)

            def step(params, state, batch):
                grads = jax.grad(loss_fn)(params, batch)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            step = jax.jit(step, out_shardings=(param_sharding, sharding))
            new_params, state = step(params, state, batch)
            new_params, state = step(new_params, state, batch)
            for leaf in jax.tree.leaves(state[0]):
                assert leaf.sharding.is_fully_replicated, (case, leaf.shape, leaf.sharding)
            for m, s in zip(jax.tree.leaves(state[1][0].mu), jax.tree.leaves(param_sharding)):
                assert m.sharding.is_equivalent_to(s, m.ndim), (case, m.sharding, s)
            values = clipjax.metrics(state)
            assert values and all(bool(jnp.all(~jnp.isnan(v))) for v in values.values()), case
        except Exception as e:  # report every case, not only the first
            failures.append(f"{case}: {type(e).__name__}: {str(e)[:400]}")
    print("\\n".join(failures) or "OK")
    raise SystemExit(1 if failures else 0)
    """
)


def test_tree_map_params_derives_sharding_on_8_devices() -> None:
    proc = scripts.python("-c", _SHARDING_SCRIPT, timeout=600, devices=8)
    output = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"opt_state sharding from tree_map_params failed:\n{output}"


_W = jnp.arange(30.0, dtype=jnp.float32).reshape(6, 5) / 10  # max |w| = 2.9

LEAF_KINDS: dict[str, Any] = {
    "python_float": 0.5,
    "python_int": 7,
    "none": None,
    "masked": optax.MaskedNode(),
    "zero_size": jnp.zeros((0, 3), jnp.float32),
    "complex": jnp.array([1 + 2j, 3 - 1j], jnp.complex64),
}
KIND_IDS = sorted(LEAF_KINDS)
# A Python int given to a norm clipper is an integer gradient (refused, see
# test_integer_gradients_refused_by_norm_clippers); global_norm and clip_by_value
# take it as optax does.
FLOAT_KIND_IDS = [k for k in KIND_IDS if k != "python_int"]


def _tree(kind: str) -> Any:
    return {"params": {"w": _W, "x": LEAF_KINDS[kind]}}


def _as_arrays(tree: Any) -> Any:
    """The same tree with Python scalars as arrays: what optax's transforms accept."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if np.isscalar(x) else x, tree)


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated")
@pytest.mark.parametrize("kind", KIND_IDS)
def test_global_norm_accepts_what_optax_accepts(kind: str) -> None:
    tree = _tree(kind)
    # optax before 0.2.6 refuses Python scalars itself: the reference sees arrays.
    expected = float(optax.global_norm(_as_arrays(tree)))
    np.testing.assert_allclose(float(optax.tree.norm(_as_arrays(tree))), expected, rtol=1e-6)
    np.testing.assert_allclose(float(clipjax.global_norm(tree)), expected, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated")
@pytest.mark.parametrize("kind", FLOAT_KIND_IDS)
def test_clip_by_global_norm_accepts_what_optax_accepts(kind: str) -> None:
    tree = _tree(kind)
    ref_tx = optax.clip_by_global_norm(1.0)
    ref, _ = ref_tx.update(_as_arrays(tree), ref_tx.init(_as_arrays(tree)))
    tx = clipjax.clip_by_global_norm(1.0, eps=0.0)
    out, state = tx.update(tree, tx.init(tree))
    chex.assert_trees_all_close(out, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        float(clipjax.metrics(state)["clip_by_global_norm/global/grad_norm"]),
        float(optax.global_norm(_as_arrays(tree))),
        rtol=1e-6,
    )


@pytest.mark.parametrize("kind", [k for k in KIND_IDS if k != "complex"])
def test_clip_by_value_accepts_what_optax_accepts(kind: str) -> None:
    # optax.clip refuses complex leaves (no ordering): no reference there, see
    # test_every_clipper_runs_on_every_leaf_kind.
    tree = _tree(kind)
    max_delta = 5.0 if kind == "python_int" else 0.2  # 7 -> 5 whatever the dtype
    ref, _ = optax.clip(max_delta).update(tree, optax.clip(max_delta).init(tree))
    tx = clipjax.clip_by_value(max_delta)
    out, _ = tx.update(tree, tx.init(tree))
    chex.assert_trees_all_close(out, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", FLOAT_KIND_IDS)
def test_agc_accepts_what_optax_accepts(kind: str) -> None:
    tree = _tree(kind)
    grads = jax.tree.map(lambda x: x * 3, tree)
    ref_tx = optax.adaptive_grad_clip(0.1)
    ref, _ = ref_tx.update(_as_arrays(grads), ref_tx.init(_as_arrays(tree)), _as_arrays(tree))
    tx = clipjax.agc(0.1)
    out, _ = tx.update(grads, tx.init(tree), tree)
    chex.assert_trees_all_close(out, ref, rtol=1e-6, atol=1e-7)


_MASKED_PAIRS = {
    "clip_by_global_norm": (
        lambda: clipjax.clip_by_global_norm(1.0, eps=0.0),
        lambda: optax.clip_by_global_norm(1.0),
    ),
    "clip_by_value": (lambda: clipjax.clip_by_value(0.2), lambda: optax.clip(0.2)),
    "agc": (lambda: clipjax.agc(0.1), lambda: optax.adaptive_grad_clip(0.1)),
}


@pytest.mark.parametrize("pair", sorted(_MASKED_PAIRS))
def test_inside_optax_masked_equals_optax(pair: str) -> None:
    mine, theirs = _MASKED_PAIRS[pair]
    params = {"params": {"w": _W, "b": jnp.full((5,), 4.0), "s": jnp.asarray(2.0)}}
    mask = {"params": {"w": True, "b": False, "s": True}}
    grads = jax.tree.map(lambda x: 3.0 * x, params)
    out = {}
    for label, make in (("clipjax", mine), ("optax", theirs)):
        tx = optax.masked(make(), mask)
        out[label], _ = jax.jit(tx.update)(grads, tx.init(params), params)
    chex.assert_trees_all_close(out["clipjax"], out["optax"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["clipjax"]["params"]["b"], grads["params"]["b"])


# jax warns before a complex -> real cast becomes an error: the imaginary part is lost.
@pytest.mark.filterwarnings("error:Casting from complex to real")
@pytest.mark.parametrize("kind", FLOAT_KIND_IDS)
@pytest.mark.parametrize("case", TRANSFORM_IDS)
def test_every_clipper_runs_on_every_leaf_kind(case: str, kind: str) -> None:
    tx = CASES[case].make()
    tree = _tree(kind)
    state = tx.init(tree)
    for step in range(3):
        grads = jax.tree.map(lambda x, f=1.0 + step: x * f, tree)
        out, state = tx.update(grads, state, tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    values = clipjax.metrics(state)
    assert values
    for key, value in values.items():
        assert not np.isnan(np.asarray(value)).any(), key
        if key.endswith("/grad_norm"):
            assert np.isfinite(np.asarray(value)).all(), key


NORM_CLIPPERS = [
    k for k in CLIPPER_IDS if CASES[k].algo not in ("clip_by_value", "clip_by_percentile")
]


@pytest.mark.parametrize("case", NORM_CLIPPERS)
def test_integer_gradients_refused_by_norm_clippers(case: str) -> None:
    tx = CASES[case].make()
    tree = {"params": {"v": jnp.ones((4, 3)), "w": jnp.array([1, 2, 3], jnp.int32)}}
    with pytest.raises(ValueError, match="integer") as info:
        state = tx.init(tree)
        tx.update(tree, state, tree)
    assert "params/w" in str(info.value)

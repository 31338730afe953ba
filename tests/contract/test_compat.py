"""Issue 12: clipjax behaves like optax wherever optax has an answer.

* zclip reports the spike boundary of its kept statistics on a non-finite step;
* hist_clip's nested warm-up clip metrics reset once the warm-up clip stops running;
* ``optax.tree_utils.tree_map_params`` works on chains holding clipjax states
  (and derives an opt_state sharding on 8 fake devices);
* every leaf kind optax accepts (Python scalars, None, masked nodes, zero-size,
  complex) is accepted, with optax's numbers where optax has some; integer
  gradients are refused with a clear error;
* an update/init tree mismatch names the first differing leaf and both shapes;
* ``agc(axis=...)`` equals ``optax.adaptive_grad_clip(axis=...)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.cases import CLIPPERS, mlp_params
from tests.conftest import version_of
from tests.paths import ROOT
from tests.transforms import IDS, TRANSFORMS


def _values(m: dict[str, jax.Array], prefix: str) -> dict[str, float]:
    """``{field: float}`` for the keys ``{prefix}/{field}``."""
    return {k[len(prefix) + 1 :]: float(v) for k, v in m.items() if k.startswith(prefix + "/")}


# --- zclip: a non-finite step reports the spike boundary -------------------------------


@pytest.mark.parametrize("mode", ["zscore", "percentile"])
@pytest.mark.parametrize("max_grad_norm", [100.0, 1.05])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_zclip_nonfinite_step_reports_spike_boundary(
    mode: str, max_grad_norm: float, bad: float
) -> None:
    z_thresh = 2.5
    tx = clipjax.zclip(warmup_steps=3, z_thresh=z_thresh, max_grad_norm=max_grad_norm, mode=mode)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    prefix = "zclip/global"
    # Norms (the leaf is 4 equal entries of g / 2, so its norm is g).
    for g in [1.0, 1.2, 0.9, 1.1, 0.95]:
        _, state = update({"w": jnp.full(4, g / 2)}, state)
    kept = _values(clipjax.metrics(state), prefix)
    grads = {"w": jnp.full(4, bad)}
    out, state = update(grads, state)
    m = _values(clipjax.metrics(state), prefix)
    expected = min(kept["mean"] + z_thresh * kept["std"], max_grad_norm)
    assert np.isfinite(m["threshold"]), f"threshold on a {bad} step is {m['threshold']}"
    np.testing.assert_allclose(m["threshold"], expected, rtol=1e-5)
    # The statistics were kept and the gradient passed through.
    assert m["mean"] == kept["mean"] and m["std"] == kept["std"]
    assert m["scale"] == 1.0 and m["nonfinite_count"] == 1.0
    assert not np.isfinite(np.asarray(out["w"])).any()


# --- hist_clip: nested warm-up clip metrics after the warm-up ------------------------


def test_hist_clip_nested_warmup_metrics_reset_after_warmup() -> None:
    tx = clipjax.hist_clip(warmup_steps=2, warmup_clip=clipjax.clip_by_global_norm(1.0))
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    nested = "hist_clip/clip_by_global_norm/global"
    # Warm-up: 0.5 (not clipped), then 5.0 (clipped by the warm-up clip).
    for g in [0.5, 5.0]:
        _, state = update({"w": jnp.full(4, g / 2)}, state)
    m = _values(clipjax.metrics(state), nested)
    assert m["clipped"] == 1.0 and m["grad_norm"] == pytest.approx(5.0)
    for g in [1.0, 1.1, 0.9]:
        _, state = update({"w": jnp.full(4, g / 2)}, state)
        m = _values(clipjax.metrics(state), nested)
        assert m["clipped"] == 0.0, "the warm-up clip did not run: clipped must read False"
        assert m["grad_norm"] == 0.0 and m["scale"] == 1.0
        # Counters keep their totals: two warm-up steps, one clipped.
        assert m["step"] == 2 and m["count"] == 2
        assert m["clipped_count"] == 1 and m["nonfinite_count"] == 0


def test_hist_clip_nested_warmup_metrics_reset_per_group() -> None:
    """per_param: each group's nested metrics reset when that group's warm-up ends."""
    tx = clipjax.hist_clip(
        warmup_steps=2, warmup_clip=clipjax.clip_by_global_norm(1.0), scope="per_param"
    )
    params = {"a": jnp.ones(4), "b": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    # "a" is clipped by the warm-up clip on its last warm-up step, "b" on its first.
    for ga, gb in [(0.5, 4.0), (3.0, 0.5)]:
        _, state = update({"a": jnp.full(4, ga / 2), "b": jnp.full(4, gb / 2)}, state)
    for _ in range(2):
        _, state = update({"a": jnp.full(4, 0.5), "b": jnp.full(4, 0.5)}, state)
        m = clipjax.metrics(state)
        for group in ("a", "b"):
            v = _values(m, f"hist_clip/clip_by_global_norm/{group}")
            assert (v["grad_norm"], v["scale"], v["clipped"]) == (0.0, 1.0, 0.0), (group, v)
            assert (v["step"], v["count"], v["clipped_count"]) == (2, 2, 1), (group, v)


# --- optax.tree_utils.tree_map_params ---------------------------------------------------


@pytest.mark.parametrize("case", IDS)
def test_tree_map_params_on_chain(case: str) -> None:
    make, _, _ = TRANSFORMS[case]
    params = mlp_params()
    tx = optax.chain(make(), optax.adam(1e-3))
    state = tx.init(params)
    mapped = optax.tree_utils.tree_map_params(
        tx, lambda p: ("P", p.shape), state, transform_non_params=lambda _: "N"
    )
    # The mapped tree is a prefix of the state (what jit's in/out_shardings
    # take): a multi-group clipper's tuple of per-leaf group indices comes back
    # as one entry, since init on optax's leafless placeholder cannot know how
    # many leaves the real tree has.
    is_mapped = lambda x: isinstance(x, str) or (isinstance(x, tuple) and x[:1] == ("P",))
    paired = jax.tree.map(lambda m, s: m, mapped, state, is_leaf=is_mapped)
    assert jax.tree.leaves(paired, is_leaf=is_mapped)
    # The clipjax state holds no copy of the params: all its leaves are non-params.
    clip_leaves = jax.tree.leaves(mapped[0])
    assert clip_leaves and all(x == "N" for x in clip_leaves)
    # adam's moments are params-shaped.
    adam = mapped[1][0]
    shapes = jax.tree.map(lambda p: ("P", p.shape), params)
    assert adam.mu == shapes and adam.nu == shapes


_SHARDING_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import clipjax
    from tests.cases import CLIPPERS, IDS, mlp_params, batches, loss_fn

    assert jax.device_count() == 8, jax.device_count()
    mesh = Mesh(jax.devices(), ("x",))
    replicated = NamedSharding(mesh, P())

    def spec(p):
        return NamedSharding(mesh, P("x") if p.shape[0] % 8 == 0 else P())

    params = mlp_params()
    param_sharding = jax.tree.map(spec, params)
    params = jax.device_put(params, param_sharding)
    batch = next(batches(1))
    failures = []
    for case in IDS:
        try:
            tx = optax.chain(CLIPPERS[case].make(), optax.adam(1e-3))
            # The state's params-shaped subtrees take the params' sharding, every other
            # leaf (clipjax's [groups] arrays, adam's count) is replicated.
            abstract = jax.eval_shape(tx.init, params)
            sharding = optax.tree_utils.tree_map_params(
                tx,
                lambda _, s: s,
                abstract,
                param_sharding,
                transform_non_params=lambda _: replicated,
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
            mu = state[1][0].mu
            for m, s in zip(jax.tree.leaves(mu), jax.tree.leaves(param_sharding)):
                assert m.sharding.is_equivalent_to(s, m.ndim), (case, m.sharding, s)
            values = clipjax.metrics(state)
            assert values and all(
                bool(jnp.all(~jnp.isnan(v))) for v in values.values()
            ), case
        except Exception as e:  # report every case, not only the first
            failures.append(f"{case}: {type(e).__name__}: {str(e)[:400]}")
    print("\\n".join(failures) or "OK")
    raise SystemExit(1 if failures else 0)
    """
)


def test_tree_map_params_derives_sharding_on_8_devices() -> None:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("PYTEST_XDIST", "PYTEST_CURRENT", "CLIPJAX_TEST_DEVICES")):
            del env[name]
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDING_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"opt_state sharding from tree_map_params failed:\n{output[-6000:]}"
    )


# --- leaf kinds optax accepts -------------------------------------------------------------

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


def _assert_trees_close(out: Any, ref: Any) -> None:
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-6, atol=1e-7)


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
    _assert_trees_close(out, ref)
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
    _assert_trees_close(out, ref)


@pytest.mark.parametrize("kind", FLOAT_KIND_IDS)
def test_agc_accepts_what_optax_accepts(kind: str) -> None:
    tree = _tree(kind)
    grads = jax.tree.map(lambda x: x * 3, tree)
    ref_tx = optax.adaptive_grad_clip(0.1)
    ref, _ = ref_tx.update(_as_arrays(grads), ref_tx.init(_as_arrays(tree)), _as_arrays(tree))
    tx = clipjax.agc(0.1)
    out, _ = tx.update(grads, tx.init(tree), tree)
    _assert_trees_close(out, ref)


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
        state = tx.init(params)
        out[label], state = jax.jit(tx.update)(grads, state, params)
    _assert_trees_close(out["clipjax"], out["optax"])
    np.testing.assert_array_equal(out["clipjax"]["params"]["b"], grads["params"]["b"])


# jax warns before a complex -> real cast becomes an error: the imaginary part is lost.
@pytest.mark.filterwarnings("error:Casting from complex to real")
@pytest.mark.parametrize("kind", FLOAT_KIND_IDS)
@pytest.mark.parametrize("case", IDS)
def test_every_clipper_runs_on_every_leaf_kind(case: str, kind: str) -> None:
    make, _, _ = TRANSFORMS[case]
    tx = make()
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


NORM_CLIPPERS = sorted(
    k for k in CLIPPERS if CLIPPERS[k].algo not in ("clip_by_value", "clip_by_percentile")
)


@pytest.mark.parametrize("case", NORM_CLIPPERS)
def test_integer_gradients_refused_by_norm_clippers(case: str) -> None:
    tx = CLIPPERS[case].make()
    tree = {"params": {"v": jnp.ones((4, 3)), "w": jnp.array([1, 2, 3], jnp.int32)}}
    with pytest.raises(ValueError, match="integer") as info:
        state = tx.init(tree)
        tx.update(tree, state, tree)
    assert "params/w" in str(info.value)


# --- update/init tree mismatch -----------------------------------------------------------


@pytest.mark.parametrize("case", IDS)
def test_mismatch_error_names_leaf_and_shapes(case: str) -> None:
    make, _, _ = TRANSFORMS[case]
    tx = make()
    seen = {"params": {"bias": jnp.ones((2,)), "kernel": jnp.ones((3,))}}
    other = {"params": {"bias": jnp.ones((2,)), "kernel": jnp.ones((4,))}}
    state = tx.init(seen)
    with pytest.raises(ValueError) as info:
        tx.update(other, state, other)
    msg = str(info.value)
    assert "params/kernel" in msg and "(3,)" in msg and "(4,)" in msg, msg
    assert msg.index("(3,)") < msg.index("(4,)"), f"init's shape first: {msg}"


# --- agc(axis=...) ------------------------------------------------------------------------


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

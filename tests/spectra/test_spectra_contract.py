"""spectra under jit, scan, inject_hyperparams and checkpoints; its layouts, non-finite
updates, the warm-up coupling and bad arguments."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

KEY = jax.random.PRNGKey(0)
TREE = {
    "kernel": jax.random.normal(KEY, (6, 10)),
    "bias": jnp.linspace(-3.0, 3.0, 10),
}
F32 = dict(dtype=jnp.float32)


def steps(tx: optax.GradientTransformation, tree=TREE, count: int = 3):
    state = tx.init(tree)
    outs = []
    for i in range(count):
        out, state = tx.update(jax.tree.map(lambda x, f=i + 1.0: x * f, tree), state)
        outs.append(out)
    return outs, state


def test_jit_equals_eager() -> None:
    tx = clipjax.spectra(2.0, apply_to="all", **F32)
    state = tx.init(TREE)
    eager, eager_state = tx.update(TREE, state)
    jitted, jit_state = jax.jit(tx.update)(TREE, state)
    chex.assert_trees_all_close(jitted, eager, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(jit_state.metrics, eager_state.metrics, rtol=1e-6)


def test_scan_equals_a_loop() -> None:
    tx = clipjax.spectra(2.0, apply_to="all", **F32)
    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x, 3 * x]), TREE)

    def body(state, g):
        out, state = tx.update(g, state)
        return state, out

    state, scanned = jax.lax.scan(body, tx.init(TREE), grads)
    looped, loop_state = steps(tx)
    chex.assert_trees_all_close(scanned, jax.tree.map(lambda *x: jnp.stack(x), *looped), rtol=1e-5)
    assert int(state.count) == 3
    chex.assert_trees_all_close(state.metrics, loop_state.metrics, rtol=1e-5)


def test_injected_c_equals_the_plain_factory() -> None:
    injected = optax.inject_hyperparams(clipjax.spectra, static_args=("iterations", "dtype"))(
        c=1.5, iterations=10, dtype=jnp.float32
    )
    plain = clipjax.spectra(1.5, **F32)
    got, got_state = jax.jit(lambda: steps(injected))()
    want, _ = steps(plain)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(clipjax.metrics(got_state)["spectra/global/threshold"]) == 1.5


def test_checkpoint_round_trip() -> None:
    serialization = pytest.importorskip("flax.serialization", reason="needs flax")
    tx = clipjax.spectra(1.0, apply_to="all", **F32)
    _, state = steps(tx)
    restored = serialization.from_bytes(tx.init(TREE), serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored.count, state.count)
    chex.assert_trees_all_equal(restored.metrics, state.metrics)
    out, _ = tx.update(TREE, restored)
    want, _ = tx.update(TREE, state)
    chex.assert_trees_all_equal(out, want)


def test_stacked_layers_equal_each_slice_clipped() -> None:
    stacked = jax.random.normal(KEY, (4, 12, 5))
    tx = clipjax.spectra(1.0, matrices=lambda name, shape: (-2, -1), **F32)
    out, state = tx.update({"w": stacked}, tx.init({"w": stacked}))
    one = clipjax.spectra(1.0, **F32)
    for layer in range(4):
        want, _ = one.update({"w": stacked[layer]}, one.init({"w": stacked[layer]}))
        np.testing.assert_allclose(out["w"][layer], want["w"], rtol=1e-5, atol=1e-7)
    # four matrices counted, one per layer
    assert 0.0 <= float(clipjax.metrics(state)["spectra/global/clipped_fraction"]) <= 1.0


def test_a_conv_kernel_is_refused_until_told_then_read_as_muons_flattened_matrix() -> None:
    kernel = {"conv": jax.random.normal(KEY, (3, 3, 4, 8))}
    with pytest.raises(ValueError, match=r"'conv' of shape \(3, 3, 4, 8\).*matrices="):
        clipjax.spectra(1.0).init(kernel)
    tx = clipjax.spectra(1.0, matrices=lambda name, shape: ((0, 1, 2), 3), **F32)
    out, _ = tx.update(kernel, tx.init(kernel))
    flat = clipjax.spectra(1.0, **F32)
    matrix = {"m": kernel["conv"].reshape(36, 8)}
    want, _ = flat.update(matrix, flat.init(matrix))
    np.testing.assert_allclose(out["conv"], want["m"].reshape(3, 3, 4, 8), rtol=1e-5, atol=1e-7)


def test_matrices_may_leave_a_leaf_and_must_name_its_axes_once() -> None:
    tree = {"embed": jnp.ones((5, 3)), "w": jnp.ones((3, 3))}
    tx = clipjax.spectra(0.5, matrices=lambda name, shape: None if name == "embed" else (0, 1))
    out, _ = tx.update(tree, tx.init(tree))
    assert out["embed"] is tree["embed"]
    for bad in [(0, 0), (0,), "rows", ((), 1), (0.5, 1)]:
        with pytest.raises(ValueError, match="spectra: matrices"):
            clipjax.spectra(1.0, matrices=lambda name, shape, bad=bad: bad).init(tree)


def test_a_non_finite_update_leaves_the_state_sound() -> None:
    # What passes: the non-finite leaf comes out non-finite (as any optax transform
    # passes it on); the other leaves are clipped as usual; the state's count and
    # counters advance, nonfinite_count counts the step, and the next finite step
    # is clipped as if the bad one had not happened.
    tx = clipjax.spectra(1.0, apply_to="all", **F32)
    state = tx.init(TREE)
    bad = {"kernel": TREE["kernel"].at[0, 0].set(jnp.nan), "bias": TREE["bias"]}
    out, state = jax.jit(tx.update)(bad, state)
    assert not np.isfinite(np.asarray(out["kernel"])).any()
    good, _ = tx.update(TREE, tx.init(TREE))
    np.testing.assert_allclose(out["bias"], good["bias"])
    m = clipjax.metrics(state)
    assert int(m["spectra/global/nonfinite_count"]) == 1 and int(state.count) == 1
    chex.assert_tree_all_finite(state.count)
    after, state = jax.jit(tx.update)(TREE, state)
    chex.assert_trees_all_close(after, good, rtol=1e-6, atol=1e-7)
    assert np.isfinite(float(clipjax.metrics(state)["spectra/global/sigma_bound"]))


def test_warmup_holds_c_times_the_learning_rate() -> None:
    schedule = optax.linear_schedule(0.0, 1e-3, 4)
    tx = clipjax.spectra(2.0, learning_rate=schedule, warmup_steps=4, **F32)
    state = tx.init(TREE)
    seen = []
    for _ in range(6):
        _, state = tx.update(TREE, state)
        seen.append(float(clipjax.metrics(state)["spectra/global/threshold"]))
    # step 0 divides by the paper's guard 1e-10; then c * lr(4) / lr(k), then c.
    assert seen[0] == pytest.approx(2.0 * 1e-3 / 1e-10, rel=1e-5)
    assert seen[1:] == pytest.approx([8.0, 4.0, 2.0 * 4 / 3, 2.0, 2.0], rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(c=0.0), "c must be > 0"),
        (dict(c=-1.0), "c must be > 0"),
        (dict(c=1.0, iterations=0), "iterations must be an int >= 1"),
        (dict(c=1.0, iterations=2.5), "iterations must be an int"),
        (dict(c=1.0, apply_to="1d"), "apply_to must be one of"),
        (dict(c=1.0, dtype=jnp.int32), "dtype must be a floating dtype"),
        (dict(c=1.0, matrices=(0, 1)), "matrices must be a callable"),
        (dict(c=1.0, warmup_steps=3), "warmup_steps needs learning_rate"),
        (dict(c=1.0, learning_rate=1e-3), "learning_rate must be a schedule"),
        (dict(c=1.0, warmup_steps=-1, learning_rate=lambda n: 1.0), "warmup_steps must be"),
        (dict(c=1.0, name="a/b"), "name must not contain"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        clipjax.spectra(**kwargs)


def test_a_tree_other_than_inits_is_refused() -> None:
    tx = clipjax.spectra(1.0)
    with pytest.raises(ValueError, match="spectra"):
        tx.update({"kernel": jnp.ones((6, 10))}, tx.init(TREE))

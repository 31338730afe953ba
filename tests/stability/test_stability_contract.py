"""``stability_monitor`` as a transform: the updates pass through untouched (no copy in the
compiled step), ``value=`` reaches it through ``optax.chain`` and ``clipjax.chain``, and
inject_hyperparams, checkpoints, ``axis_name`` and bad arguments. The generic contract
(tests/contract, registry case ``stability_monitor``) covers jit, scan and donation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import bytes_accessed, full_size_copies, ordinary_path
from tests.trees import assert_trees_equal

P = "stability_monitor/global/"
PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
# A calm stream of norms, then spikes: 1 + 0.01 noise, 30 at steps 12 and 25.
NORMS = 1.0 + 0.01 * np.random.default_rng(0).standard_normal(30)
NORMS[[12, 25]] = 30.0
LOSSES = 3.0 + 0.01 * np.random.default_rng(1).standard_normal(30)


def grads(t: int) -> dict[str, jax.Array]:
    """Gradients of global norm ``NORMS[t]``."""
    g = {"w": jnp.full((4, 3), 1.0), "b": jnp.full((3,), 1.0)}
    return jax.tree.map(lambda x: x * (NORMS[t] / np.sqrt(15.0)), g)


def run(tx: Any, steps: range, state: Any = None, update: Any = None) -> Any:
    state = tx.init(PARAMS) if state is None else state
    update = jax.jit(tx.update) if update is None else update
    for t in steps:
        _, state = update(grads(t), state, PARAMS, value=LOSSES[t])
    return state


def test_updates_are_returned_as_they_came() -> None:
    tx = clipjax.stability_monitor(window_size=4, rolling_window=6)
    state = tx.init(PARAMS)
    g = grads(0)
    out, _ = tx.update(g, state, PARAMS, value=1.0)
    assert out is g  # the same object: no arithmetic, no copy
    out, _ = jax.jit(tx.update)(g, state, PARAMS, value=1.0)
    assert_trees_equal(out, g)


def _step(tx: Any) -> tuple[Any, int]:
    """A donated step ``(params, state, grads, loss)`` through ``tx``, then adamw, on a tree
    of 98,560 parameters (no leaf shaped like a window), compiled; and its gradient bytes."""
    shapes = {
        "kernel": jax.ShapeDtypeStruct((384, 256), jnp.float32),
        "bias": jax.ShapeDtypeStruct((256,), jnp.float32),
    }
    tx = optax.chain(tx, optax.adamw(1e-3))

    def step(params: Any, state: Any, grads: Any, loss: Any) -> Any:
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state

    loss = jax.ShapeDtypeStruct((), jnp.float32)
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(shapes, tx.init(shapes), shapes, loss)
    return lowered.compile(), 4 * (384 * 256 + 256)


def test_the_compiled_step_holds_no_copy_of_the_updates() -> None:
    """With and without the monitor chained first: no full-size copy either way."""
    leaf_shapes = {(384, 256), (256,)}
    for tx in (optax.identity(), clipjax.stability_monitor()):
        assert full_size_copies(_step(tx)[0].as_text(), leaf_shapes) == 0


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 5),
    reason="bytes-accessed bounds are calibrated on jaxlib >= 0.5's cost analysis",
)
def test_bytes_accessed_are_the_norm_and_the_windows() -> None:
    """XLA's bytes accessed (repeatable), over the same step without the monitor: its global
    norm and its windows, nothing else. The norm reads the gradients once; XLA:CPU's
    reduction fusion does not take the square in, so the squares are written and read
    back: 3.0 gradient bytes (a backend that fuses the square: 1.0). The windows: two
    float32[128] and a bool[10000], read, copied and written, under 64 KB (measured:
    3.0 gradient bytes + 51 KB).
    Measured on the ordinary path (tests/compiled_step.py: the overflow recompute, a
    branch no ordinary step takes, left out)."""
    with ordinary_path():
        plain, grad_bytes = _step(optax.identity())
        monitored, _ = _step(clipjax.stability_monitor())
    extra = bytes_accessed(monitored) - bytes_accessed(plain)
    assert 0.9 * grad_bytes <= extra <= 3.05 * grad_bytes + 64 * 1024, (extra, grad_bytes)


@pytest.mark.parametrize("chain", [optax.chain, clipjax.chain])
def test_value_reaches_the_monitor_chained_first(chain: Any) -> None:
    tx = chain(clipjax.stability_monitor(window_size=4), clipjax.zclip(), optax.adamw(1e-3))
    state = tx.init(PARAMS)
    for t in range(3):
        _, state = jax.jit(tx.update)(grads(t), state, PARAMS, value=LOSSES[t])
    got = clipjax.metrics(state)
    assert float(got[P + "value"]) == np.float32(LOSSES[2])
    assert float(got[P + "grad_norm"]) == pytest.approx(NORMS[2], rel=1e-6)
    assert float(got["zclip/global/grad_norm"]) == pytest.approx(NORMS[2], rel=1e-6)


def test_spikes_of_the_calm_stream() -> None:
    state = run(clipjax.stability_monitor(window_size=8, rolling_window=10), range(30))
    got = clipjax.metrics(state)
    assert int(got[P + "spike_count"]) == 2 and int(got[P + "step"]) == 30
    assert float(got[P + "spike_score"]) == pytest.approx(0.1)  # step 25 of the last 10
    assert float(got[P + "spike_score_total"]) == pytest.approx(2 / 30)


def test_scan_equals_the_jitted_loop() -> None:
    tx = clipjax.stability_monitor(window_size=8, rolling_window=10)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[grads(t) for t in range(30)])

    def step(state: Any, x: Any) -> tuple[Any, None]:
        g, loss = x
        return tx.update(g, state, PARAMS, value=loss)[1], None

    scanned, _ = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(
        tx.init(PARAMS), (stacked, jnp.asarray(LOSSES, jnp.float32))
    )
    assert_trees_equal(scanned, run(tx, range(30)))


def test_threshold_std_is_injected() -> None:
    inject = optax.inject_hyperparams(clipjax.stability_monitor, static_args=("window_size",))
    tx = inject(window_size=8, threshold_std=6.0)
    state = run(tx, range(30))
    plain = run(clipjax.stability_monitor(window_size=8), range(30))
    assert_trees_equal(clipjax.metrics(state), clipjax.metrics(plain))
    # Scheduled: a threshold of 1e6 from step 15 on sees the spike of step 25 no more.
    state = run(tx, range(15))
    state.hyperparams["threshold_std"] = jnp.asarray(1e6)
    state = run(tx, range(15, 30), state)
    assert int(clipjax.metrics(state)[P + "spike_count"]) == 1


def test_flax_and_orbax_checkpoints_resume_bit_identically(tmp_path: Path) -> None:
    serialization = pytest.importorskip("flax.serialization")
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = optax.chain(clipjax.stability_monitor(window_size=8, rolling_window=10), optax.sgd(0.1))
    middle = run(tx, range(15))
    expected = run(tx, range(15, 30), middle)
    restored = serialization.from_bytes(tx.init(PARAMS), serialization.to_bytes(middle))
    assert_trees_equal(run(tx, range(15, 30), restored), expected)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", middle)
        checkpointer.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(PARAMS))
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert_trees_equal(run(tx, range(15, 30), restored), expected)


def test_axis_name_averages_the_norm_and_the_loss_over_replicas() -> None:
    """Under vmap with axis_name, every replica records what one monitor fed the
    replicas' mean norm and mean loss records."""
    factors = jnp.asarray([0.5, 1.0, 2.5])
    tx = clipjax.stability_monitor(window_size=8, rolling_window=10, axis_name="i")
    single = clipjax.stability_monitor(window_size=8, rolling_window=10)
    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (3, *a.shape)), tx.init(PARAMS))
    one = single.init(PARAMS)
    update = jax.jit(jax.vmap(lambda g, s, v: tx.update(g, s, PARAMS, value=v), axis_name="i"))
    for t in range(30):
        local = jax.tree.map(lambda x: factors.reshape(3, *[1] * x.ndim) * x, grads(t))
        _, state = update(local, state, LOSSES[t] * factors)
        mean = float(jnp.mean(factors))
        g = jax.tree.map(lambda x, m=mean: x * m, grads(t))
        _, one = single.update(g, one, PARAMS, value=LOSSES[t] * mean)
    got, want = clipjax.metrics(state), clipjax.metrics(one)
    for key, value in want.items():
        for r in range(3):
            np.testing.assert_allclose(np.asarray(got[key])[r], value, rtol=1e-6, err_msg=key)
    assert int(want[P + "spike_count"]) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(window_size=0), "window_size must be an int >= 1"),
        (dict(window_size=2.5), "window_size must be an int"),
        (dict(window_size=jnp.asarray(8)), "window_size fixes shapes"),
        (dict(rolling_window=0), "rolling_window must be an int >= 1"),
        (dict(threshold_std=0.0), "threshold_std must be > 0"),
        (dict(threshold_std=-1.0), "threshold_std must be > 0"),
        (dict(threshold_std="6"), "threshold_std must be a number"),
        (dict(name="a/b"), "name must not contain '/'"),
        (dict(axis_name=3), "axis_name must be a str"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        clipjax.stability_monitor(**kwargs)


def test_bad_updates_are_refused() -> None:
    tx = clipjax.stability_monitor()
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="value must be a scalar"):
        tx.update(grads(0), state, PARAMS, value=jnp.ones(2))
    with pytest.raises(ValueError, match="integer"):
        ints = {"w": jnp.ones((4, 3), jnp.int32), "b": jnp.zeros(3)}
        tx.update(ints, tx.init(ints), ints)
    with pytest.raises(TypeError, match="StabilityMonitorState"):
        tx.update(grads(0), clipjax.zclip().init(PARAMS), PARAMS)


def test_in_front_of_skip_on_spike_it_sees_the_skipped_steps() -> None:
    """Inside a wrapper that skips, a skipped step leaves its state as it was (docs: put it
    in front); in front, it counts the spike the wrapper skips."""
    monitor = lambda: clipjax.stability_monitor(window_size=8, rolling_window=10)
    skip = lambda inner: clipjax.skip_on_spike(inner, window_size=8, min_history=8)
    front = optax.chain(monitor(), skip(clipjax.adamw(1e-3)))
    inside = skip(clipjax.chain(monitor(), clipjax.adamw(1e-3)))
    got = {k: clipjax.metrics(run(tx, range(15))) for k, tx in (("front", front), ("in", inside))}
    assert bool(got["front"]["skip_on_spike/global/skipped"][()]) is False
    assert int(got["front"]["skip_on_spike/global/skipped_count"]) == 1  # step 12
    assert int(got["front"][P + "spike_count"]) == 1 and int(got["front"][P + "step"]) == 15
    assert int(got["in"][P + "spike_count"]) == 0 and int(got["in"][P + "step"]) == 14

"""clipjax inside inject_hyperparams, MultiSteps, masked, partition and apply_if_finite;
``clipjax.metrics`` reads through all of them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.model import mlp_params, random_grads
from tests.registry import CLIPPER_IDS, all_clippers, clipjax_states
from tests.trees import assert_trees_close, assert_trees_equal

PARAMS = mlp_params()


def gradients(step: int, spike: int | None = 5) -> Any:
    """Gaussian gradients shaped like ``PARAMS``, x40 at step ``spike``."""
    return random_grads(PARAMS, seed=1000 + step, scale=40.0 if step == spike else 1.0)


def labels(kernel: Any, other: Any) -> Any:
    """``kernel`` at the kernels of ``PARAMS``, ``other`` at the other leaves."""
    label = lambda path, _: kernel if path[-1].key == "kernel" else other
    return jax.tree_util.tree_map_with_path(label, PARAMS)


# case -> (factory, static_args, fixed kwargs, {hyperparameter: (first value, second value)}).
# static_args: the numbers that fix shapes or Python control flow (inject_hyperparams
# would make them arrays); strings, bools and None stay static unnamed.


def hist_clip_zstat(alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 20) -> Any:
    """hist_clip's numbers live in its criterion: a factory that takes them."""
    return clipjax.hist_clip(clipjax.zstat_criterion(alpha, z_thresh), warmup_steps=warmup_steps)


def case(factory: Any, static: tuple[str, ...] = (), fixed: Any = None, **hyper: Any) -> tuple:
    return factory, static, fixed or {}, hyper


EPS = {"eps": (1e-8, 1e-2)}
PERCENTILE = {"mode": "percentile", "warmup_steps": 3, "min_history": 3}
AGC = {"clipping": (0.05, 0.01), "eps": (1e-3, 1e-1)}
INJECT = {
    "clip_by_global_norm": case(
        clipjax.clip_by_global_norm, ("norm_type",), max_norm=(5.0, 1.0), eps=(1e-7, 1e-3)
    ),
    "zclip": case(
        clipjax.zclip,
        ("warmup_steps",),
        {"warmup_steps": 3},
        alpha=(0.97, 0.8),
        z_thresh=(2.5, 1.0),
        max_grad_norm=(100.0, 20.0),
        eps=(1e-6, 1e-3),
        clip_factor=(1.0, 0.7),
    ),
    "hist_clip": case(
        hist_clip_zstat,
        ("warmup_steps",),
        {"warmup_steps": 3},
        alpha=(0.97, 0.8),
        z_thresh=(2.5, 1.0),
    ),
    "agc": case(clipjax.agc, **AGC),
    "agc_per_layer": case(clipjax.agc, (), {"scope": "per_layer"}, **AGC),
    "autoclip": case(
        clipjax.autoclip, ("window_size",), warmup_steps=(3, 6), min_history=(2, 3), **EPS
    ),
    "autoclip_window": case(
        clipjax.autoclip,
        ("window_size",),
        {**PERCENTILE, "window_size": 4},
        percentile=(95.0, 50.0),
        **EPS,
    ),
    "autoclip_ema": case(
        clipjax.autoclip,
        ("window_size",),
        {**PERCENTILE, "history": "ema"},
        percentile=(95.0, 50.0),
        ema_decay=(0.99, 0.8),
    ),
    "zscore_clip": case(
        clipjax.zscore_clip,
        zmax=(3.0, 1.0),
        ema_decay=(0.99, 0.8),
        warmup_steps=(3, 6),
        min_history=(2, 3),
        **EPS,
    ),
    "clip_by_value": case(clipjax.clip_by_value, max_abs=(1.0, 0.05)),
    "clip_by_percentile": case(clipjax.clip_by_percentile, percentile=(90.0, 50.0)),
    "normalize_per_param": case(clipjax.normalize_per_param, eps=(1e-8, 1e-1)),
    "zscore_normalize": case(clipjax.zscore_normalize, eps=(1e-8, 1e-1)),
}

SWITCH = 4  # the step at which the injected hyperparameters change
STEPS = 8


@pytest.mark.parametrize("case", sorted(INJECT))
def test_inject_hyperparams_equals_the_clipper_built_with_those_values(case: str) -> None:
    factory, static, fixed, hyper = INJECT[case]
    first = {k: a for k, (a, _) in hyper.items()}
    second = {k: b for k, (_, b) in hyper.items()}
    injected = optax.inject_hyperparams(factory, static_args=static)(**fixed, **first)
    update = jax.jit(injected.update)
    state = injected.init(PARAMS)
    direct_state = factory(**fixed, **first).init(PARAMS)
    direct_updates = {id(v): jax.jit(factory(**fixed, **v).update) for v in (first, second)}
    for t in range(STEPS):
        values = first if t < SWITCH else second
        if t == SWITCH:
            state.hyperparams.update({k: jnp.asarray(v, jnp.float32) for k, v in second.items()})
        out, state = update(gradients(t), state, PARAMS)
        expected, direct_state = direct_updates[id(values)](gradients(t), direct_state, PARAMS)
        # Python floats enter the direct clipper's arithmetic in float64 before
        # rounding to float32; injected ones are float32 arrays: last-bit noise.
        assert_trees_close(out, expected, 1e-5, f"{case} step {t} updates ")
        assert_trees_close(clipjax_states(state), [direct_state], 1e-5, f"{case} step {t} ")
    m = clipjax.metrics(state)
    assert m.keys() == clipjax.metrics(direct_state).keys()
    assert any(k.endswith("/step") for k in m)


@pytest.mark.parametrize(
    ("factory", "kwargs", "arg"),
    [
        (clipjax.clip_by_global_norm, {"max_norm": 1.0, "norm_type": 2.0}, "norm_type"),
        # Passed as a number (in a mode whose history reads it) it must be static.
        (clipjax.autoclip, {"mode": "percentile", "window_size": 1024}, "window_size"),
    ],
    ids=["clip_by_global_norm-norm_type", "autoclip-window_size"],
)
def test_shape_and_control_flow_hyperparameters_must_be_static(
    factory: Any, kwargs: dict[str, Any], arg: str
) -> None:
    tx = optax.inject_hyperparams(factory)(**kwargs)
    with pytest.raises(ValueError, match=f"{arg}.*static_args"):
        jax.jit(tx.update)(gradients(0), tx.init(PARAMS), PARAMS)


def test_a_schedule_drives_max_norm_and_metrics_follow() -> None:
    schedule = optax.linear_schedule(4.0, 1.0, transition_steps=3)
    tx = optax.inject_hyperparams(clipjax.clip_by_global_norm, static_args="norm_type")(
        max_norm=schedule, eps=0.0
    )
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for t in range(5):
        grads = gradients(t, spike=None)
        out, state = update(grads, state, PARAMS)
        m = clipjax.metrics(state)
        norm = float(optax.tree.norm(grads))
        np.testing.assert_allclose(float(m["clip_by_global_norm/global/grad_norm"]), norm, 1e-6)
        scale = min(1.0, float(schedule(t)) / norm)
        np.testing.assert_allclose(float(m["clip_by_global_norm/global/scale"]), scale, 1e-6)
        np.testing.assert_allclose(float(optax.tree.norm(out)), scale * norm, 1e-5)
        assert float(state.hyperparams["max_norm"]) == pytest.approx(float(schedule(t)))


def test_a_schedule_drives_z_thresh_inside_jit() -> None:
    tx = optax.chain(
        optax.inject_hyperparams(clipjax.zclip, static_args="warmup_steps")(
            z_thresh=optax.linear_schedule(3.0, 1.0, transition_steps=8), warmup_steps=3
        ),
        optax.sgd(0.1),
    )

    @jax.jit
    def step(state: Any, grads: Any) -> Any:
        _, state = tx.update(grads, state, PARAMS)
        return state, clipjax.metrics(state)

    state = tx.init(PARAMS)
    for t in range(8):
        state, m = step(state, gradients(t))
    assert int(m["zclip/global/step"]) == 8
    assert int(m["zclip/global/clipped_count"]) >= 1  # the spike at step 5
    assert m.keys() == clipjax.metrics(state).keys()


K = 3  # mini-steps per real step
REAL_STEPS = 4


def mini_grads(real: int, mini: int) -> Any:
    return gradients(10 * real + mini, spike=10 * 2 + 1)  # one spiking mini-batch in step 2


def multi_steps_run() -> list[Any]:
    """The MultiSteps state after every mini-step, over every clipper."""
    tx = optax.MultiSteps(optax.chain(all_clippers(), optax.sgd(0.1)), every_k_schedule=K)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    out = []
    for real in range(REAL_STEPS):
        for mini in range(K):
            _, state = update(mini_grads(real, mini), state, PARAMS)
            out.append(jax.device_get(state))
    return out


def test_multi_steps_clips_the_accumulated_gradient_once_per_real_step() -> None:
    reference = optax.chain(all_clippers(), optax.sgd(0.1))
    ref_state = reference.init(PARAMS)
    ref_update = jax.jit(reference.update)
    states = multi_steps_run()
    for real in range(REAL_STEPS):
        mean = jax.tree.map(lambda *g: sum(g) / K, *[mini_grads(real, mini) for mini in range(K)])
        _, ref_state = ref_update(mean, ref_state, PARAMS)
        # Mid-steps leave the clipper states as they were; the K-th updates them.
        for mini in range(K - 1 if real else 0):
            before = states[real * K - 1].inner_opt_state
            assert_trees_equal(states[real * K + mini].inner_opt_state, before)
        emitted = states[real * K + K - 1]
        assert_trees_close(emitted.inner_opt_state[0], ref_state[0], 1e-5, f"real step {real} ")
    m = clipjax.metrics(states[-1])
    steps = {int(v) for k, v in m.items() if k.endswith("/step") and k.count("/") == 2}
    assert steps == {REAL_STEPS}  # one observation per real step, not per mini-step
    # Every clipper's metrics, through MultiSteps.
    assert {k.split("/")[0] for k in m} == set(CLIPPER_IDS)
    assert bool(clipjax.metrics(states[3 * K - 1])["zclip/global/clipped"])


# One clipper per way of grouping leaves: the engine, agc's unitwise path, the
# element-wise clippers.
MASKED = ["zclip_per_layer", "hist_clip", "agc", "clip_by_percentile"]


def test_masked_clips_only_the_selected_leaves() -> None:
    tx = optax.masked(all_clippers(MASKED), labels(True, False))
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    kernels = lambda t: {"params": {k: {"kernel": v["kernel"]} for k, v in t["params"].items()}}
    direct = all_clippers(MASKED)
    direct_update = jax.jit(direct.update)
    direct_state = direct.init(kernels(PARAMS))
    for t in range(7):
        grads = gradients(t)
        out, state = update(grads, state, PARAMS)
        expected, direct_state = direct_update(kernels(grads), direct_state, kernels(PARAMS))
        for layer in ("Dense_0", "Dense_1"):
            got, g, e = out["params"][layer], grads["params"][layer], expected["params"][layer]
            np.testing.assert_array_equal(got["bias"], g["bias"])
            np.testing.assert_allclose(got["kernel"], e["kernel"], rtol=1e-6)
    m = clipjax.metrics(state)
    assert m.keys() == clipjax.metrics(direct_state).keys()
    assert not any("bias" in k for k in m)
    assert "agc/params/Dense_0/kernel/scale" in m  # unitwise agc names its groups by leaf


def test_partition_runs_a_clipper_per_group_of_parameters() -> None:
    kernels = clipjax.zclip(warmup_steps=2, scope="per_layer")
    tx = {"kernels": kernels, "biases": clipjax.clip_by_global_norm(0.5)}
    tx = optax.partition(tx, labels("kernels", "biases"))
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for t in range(6):
        grads = gradients(t)
        out, state = update(grads, state, PARAMS)
    m = clipjax.metrics(state)
    groups = {"zclip/params/Dense_0", "zclip/params/Dense_1", "clip_by_global_norm/global"}
    assert {k.rsplit("/", 1)[0] for k in m} == groups
    biases = lambda t: [t["params"][k]["bias"] for k in ("Dense_0", "Dense_1")]
    bias_norm = float(optax.tree.norm(biases(grads)))
    np.testing.assert_allclose(float(m["clip_by_global_norm/global/grad_norm"]), bias_norm, 1e-6)
    kernel_norm = float(jnp.linalg.norm(grads["params"]["Dense_1"]["kernel"]))
    np.testing.assert_allclose(float(m["zclip/params/Dense_1/grad_norm"]), kernel_norm, 1e-6)
    assert float(optax.tree.norm(biases(out))) <= 0.5 + 1e-6


def test_partition_with_two_clippers_of_one_kind_names_them_apart() -> None:
    two = labels("a_kernels", "b_biases")
    tx = optax.partition({"a_kernels": clipjax.zclip(), "b_biases": clipjax.zclip()}, two)
    _, state = tx.update(gradients(0), tx.init(PARAMS), PARAMS)
    m = clipjax.metrics(state)
    assert {k.split("/")[0] for k in m} == {"zclip", "zclip_1"}  # in tree order: a, then b
    named = {"a_kernels": clipjax.zclip(name="kernels"), "b_biases": clipjax.zclip(name="biases")}
    named = optax.partition(named, two)
    _, state = named.update(gradients(0), named.init(PARAMS), PARAMS)
    assert {k.split("/")[0] for k in clipjax.metrics(state)} == {"kernels", "biases"}


def with_nan(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    leaves[0] = leaves[0].reshape(-1).at[0].set(jnp.nan).reshape(leaves[0].shape)
    return jax.tree.unflatten(treedef, leaves)


def if_finite_run() -> list[tuple[Any, Any]]:
    """Steps 0-3 finite, 4-6 NaN (the third exceeds max_consecutive_errors=2), 7 finite."""
    tx = optax.apply_if_finite(
        optax.chain(all_clippers(), optax.sgd(0.1)), max_consecutive_errors=2
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    out = []
    for t in range(8):
        grads = with_nan(gradients(t, spike=None)) if 4 <= t <= 6 else gradients(t, spike=None)
        updates, state = update(grads, state, PARAMS)
        out.append(jax.device_get((updates, state)))
    return out


def test_apply_if_finite_drops_the_step_before_the_clipper_sees_it() -> None:
    run = if_finite_run()
    for name in CLIPPER_IDS:
        check_if_finite(name, run)
    state = run[-1][1]
    assert int(state.total_notfinite) == 3
    assert clipjax.metrics(state).keys() == clipjax.metrics(state.inner_state).keys()


def check_if_finite(name: str, run: list[tuple[Any, Any]]) -> None:
    clip = [clipjax_states(state.inner_state[0][name])[0] for _, state in run]
    # Steps 4 and 5 are rejected whole: zero updates, the clipper's state as after step 3.
    for t in (4, 5):
        assert all(not np.any(x) for x in jax.tree.leaves(run[t][0]))
        assert_trees_equal(clip[t], clip[3], f"{name} step {t}")
    # Step 6 is let through (third error in a row): the clipper counts it as
    # non-finite and keeps it out of its statistics.
    m3, m6, m7 = (clipjax.metrics(clip[t]) for t in (3, 6, 7))
    for key, value in m6.items():
        if key.count("/") != 2:
            continue  # hist_clip's warm-up clip, nested
        field = key.rsplit("/", 1)[1]
        if field == "nonfinite_count":
            assert int(value) == 1, key
        elif field == "count":
            assert int(value) == int(m3[key]), key
        elif field == "step":
            assert int(value) == 5 and int(m7[key]) == 6, key  # steps 0-3, 6 (and 7)

"""Overflow-safe norms (SPEC 9.8): a finite gradient with one element of 3e19 (a float32 sum
of squares of inf) has a finite norm, so it is a spike like any other: every clipper reports
and clips it, adam after it moves on, the wrappers skip it as non-finite (SPEC 9.2); the group
norms equal a float64 restatement, and an ordinary step compiles without full-size copies."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _grouping
from tests.compiled_step import compiled_train_step, full_size_copies
from tests.registry import CASES

HUGE = 3e19  # its float32 square (9e38) overflows; the norm (3e19) does not


def params() -> dict[str, Any]:
    return {
        "dense": {"w": jnp.full((8, 4), 0.1), "b": jnp.zeros(4)},
        "head": {"w": jnp.full((4, 2), 0.1), "b": jnp.zeros(2)},
    }


def ordinary(step: int) -> dict[str, Any]:
    """A gradient of norm about 0.5, a little different each step."""
    return jax.tree.map(lambda p: jnp.full(p.shape, 0.1 + 0.01 * step, p.dtype), params())


def spiked() -> dict[str, Any]:
    g = ordinary(0)
    g["dense"]["w"] = g["dense"]["w"].at[0, 0].set(HUGE)
    return g


REGISTERED = """clip_by_global_norm zclip zclip_per_layer zclip_per_param hist_clip
    hist_clip_ema_per_layer autoclip autoclip_window autoclip_ema zscore_clip adagc agc
    agc_per_layer clip_by_historical_norm clip_norm_growth clip_norm_growth_per_layer
    clip_norm_by_ema clip_by_value clip_by_percentile normalize_per_param"""
CLIPPERS = {n: CASES[n].make for n in REGISTERED.split()} | {
    "zclip_clipped": lambda: clipjax.zclip(warmup_steps=3, feedback="clipped"),
    "zclip_raw": lambda: clipjax.zclip(warmup_steps=3, feedback="raw"),
    "clip_by_global_norm_p3": lambda: clipjax.clip_by_global_norm(1.0, norm_type=3),
}
# The clippers whose bound is a norm of the whole update.
GLOBAL = {"clip_by_global_norm", "zclip", "zclip_clipped", "zclip_raw", "hist_clip"}
GLOBAL |= {"autoclip", "autoclip_window", "autoclip_ema", "zscore_clip", "clip_by_historical_norm"}


def run(tx: optax.GradientTransformation, steps: int = 5) -> tuple[Any, Any]:
    """``tx`` after ``steps`` ordinary steps, then the spiked one: (output, state)."""
    p = params()
    update = jax.jit(tx.update)
    state = tx.init(p)
    for k in range(steps):
        _, state = update(ordinary(k), state, p)
    return update(spiked(), state, p)


def grad_norms(state: Any) -> dict[str, float]:
    return {k: float(v) for k, v in clipjax.metrics(state).items() if k.endswith("/grad_norm")}


@pytest.mark.parametrize("case", sorted(CLIPPERS))
def test_a_finite_spike_has_a_finite_norm_and_is_clipped(case: str) -> None:
    out, state = run(CLIPPERS[case]())
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
    norms = grad_norms(state)
    top = max(norms.values())
    assert math.isfinite(top)
    # The group holding the huge element (p = 3: its 3-norm, the same to float32).
    assert top == pytest.approx(HUGE, rel=1e-5)
    # Clipped to something ordinary (the bound of each rule is of the order of the
    # norms seen, or of the weights for AGC), not passed.
    assert float(optax.tree.norm(out)) < 10.0
    if case in GLOBAL:  # in its own direction: the huge element carries the whole update
        w00 = float(out["dense"]["w"][0, 0])
        assert w00 == pytest.approx(float(optax.tree.norm(out)), rel=1e-4)


@pytest.mark.parametrize("case", sorted(GLOBAL))
def test_a_global_clip_bounds_the_spike_by_its_threshold(case: str) -> None:
    out, state = run(CLIPPERS[case]())
    m = clipjax.metrics(state)
    [threshold] = [m[k] for k in m if k.count("/") == 2 and k.endswith("/global/threshold")]
    assert float(optax.tree.norm(out)) <= float(threshold) * (1 + 1e-5)


AROUND_ADAM = {
    "skip_on_spike": lambda: clipjax.skip_on_spike(
        clipjax.adam(1e-2), window_size=4, min_history=2
    ),
    # before min_history: skipped all the same
    "skip_on_spike_early": lambda: clipjax.skip_on_spike(clipjax.adam(1e-2), window_size=16),
    "skip_and_clip": lambda: clipjax.skip_and_clip_by_global_norm(optax.adam(1e-2), max_norm=1.0),
    "skip_and_clip_drop": lambda: clipjax.skip_and_clip_by_global_norm(
        clipjax.adamw(1e-2), drop_norm=100.0
    ),
    "folded_adamw": lambda: clipjax.chain(clipjax.zclip(warmup_steps=3), clipjax.adamw(1e-2)),
    "folded_adam_clip_by_global_norm": lambda: clipjax.chain(
        clipjax.clip_by_global_norm(1.0), clipjax.adam(1e-2)
    ),
}
ADAM_CASES = [*sorted(CLIPPERS), *AROUND_ADAM]


def adam_after(case: str) -> optax.GradientTransformation:
    if case in AROUND_ADAM:
        return AROUND_ADAM[case]()
    return optax.chain(CLIPPERS[case](), optax.adam(1e-2))


def moments_finite(state: Any) -> bool:
    """Every full-size float array of ``state`` (adam's moments) is finite."""
    shapes = {jnp.shape(x) for x in jax.tree.leaves(params())}
    return all(
        bool(jnp.all(jnp.isfinite(x)))
        for x in jax.tree.leaves(state)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.shape(x) in shapes
    )


@pytest.mark.parametrize("case", ADAM_CASES)
def test_adam_after_it_keeps_moving(case: str) -> None:
    tx = adam_after(case)
    p = params()

    @jax.jit
    def step(p: Any, state: Any, g: Any) -> tuple[Any, Any]:
        updates, state = tx.update(g, state, p, value=jnp.float32(1.0))
        return optax.apply_updates(p, updates), state

    state = tx.init(p)
    for k in range(5):
        p, state = step(p, state, ordinary(k))
    p, state = step(p, state, spiked())
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))
    assert moments_finite(state)
    norms = grad_norms(state)
    if norms:  # the wrappers' norm, or the clipper's
        assert all(math.isfinite(v) for v in norms.values())
    before = p["dense"]["w"][0, 0]
    for k in range(3):
        p, state = step(p, state, ordinary(k))
    assert float(p["dense"]["w"][0, 0]) != float(before)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))


@pytest.mark.parametrize("case", ["skip_on_spike", "skip_on_spike_early", "skip_and_clip_drop"])
def test_the_wrappers_skip_it_as_non_finite_and_report_its_norm(case: str) -> None:
    tx = adam_after(case)
    p = params()
    update = jax.jit(lambda g, s: tx.update(g, s, p, value=jnp.float32(1.0)))
    state = tx.init(p)
    for k in range(5):
        _, state = update(ordinary(k), state)
    out, state = update(spiked(), state)
    metrics = clipjax.metrics(state)
    prefix = "skip_on_spike" if case.startswith("skip_on") else "skip_and_clip_by_global_norm"
    assert bool(metrics[f"{prefix}/global/skipped"])
    assert int(metrics[f"{prefix}/global/nonfinite_count"]) == 1
    assert float(metrics[f"{prefix}/global/grad_norm"]) == pytest.approx(HUGE, rel=1e-5)
    assert all(not bool(jnp.any(x)) for x in jax.tree.leaves(out))


def test_skip_and_clip_with_max_norm_only_skips_it_too() -> None:
    tx = adam_after("skip_and_clip")
    p = params()
    state = tx.init(p)
    out, state = jax.jit(tx.update)(spiked(), state, p)
    metrics = clipjax.metrics(state)
    assert bool(metrics["skip_and_clip_by_global_norm/global/skipped"])
    assert all(not bool(jnp.any(x)) for x in jax.tree.leaves(out))


def restated(leaves: list[np.ndarray], labels: list[int], groups: int, p: float) -> np.ndarray:
    out = np.zeros(groups)
    for x, g in zip(leaves, labels):
        out[g] += np.sum(np.abs(np.asarray(x, np.float64)) ** p)
    return out ** (1 / p)


def trees() -> dict[str, dict[str, Any]]:
    ordinary_tree = {"a": jnp.linspace(-1.0, 2.0, 12).reshape(3, 4), "b": jnp.arange(5.0)}
    one_huge = {"a": ordinary_tree["a"].at[1, 2].set(HUGE), "b": ordinary_tree["b"]}
    many = {"a": jnp.full((3, 4), 1e19), "b": jnp.full(5, -1e19)}
    return {"ordinary": ordinary_tree, "one_huge": one_huge, "many_1e19": many}


@pytest.mark.parametrize("p", [2.0, 3.0, 1.5])
@pytest.mark.parametrize("scope", ["global", "per_param"])
@pytest.mark.parametrize("which", ["ordinary", "one_huge", "many_1e19"])
@pytest.mark.parametrize("jit", [False, True])
def test_group_norms_equal_a_float64_restatement(
    p: float, scope: str, which: str, jit: bool
) -> None:
    tree = trees()[which]
    leaves, _, _ = _grouping.leaves_with_names(tree)
    grouping = _grouping.make_grouping(tree, scope)
    norms = _grouping.group_norms
    if jit:
        norms = jax.jit(norms, static_argnums=(1, 2))
    got = np.asarray(norms(leaves, grouping, p))
    want = restated(leaves, list(grouping.leaf_groups), grouping.num_groups, p)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_leaf_and_stacked_and_global_norms_are_finite() -> None:
    tree = trees()["one_huge"]
    assert float(clipjax.global_norm(tree)) == pytest.approx(HUGE, rel=1e-6)
    leaves, _, _ = _grouping.leaves_with_names(tree)
    squares = _grouping.leaf_power_sums(leaves)
    got = np.asarray(jax.jit(_grouping.leaf_norms)(leaves, squares))
    np.testing.assert_allclose(got, [HUGE, float(np.linalg.norm(np.arange(5.0)))], rtol=1e-6)
    stacked = {"layers": {"w": jnp.ones((3, 4, 2)).at[1, 0, 0].set(HUGE)}}
    tx = clipjax.zclip(scope=clipjax.stacked("per_param"))
    _, state = tx.update(stacked, tx.init(stacked))
    norms = grad_norms(state)
    assert norms["zclip/layers/1/w/grad_norm"] == pytest.approx(HUGE, rel=1e-6)
    assert norms["zclip/layers/0/w/grad_norm"] == pytest.approx(math.sqrt(8))


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("p", [2.0, 3.0])
def test_a_non_finite_element_still_gives_a_non_finite_norm(bad: float, p: float) -> None:
    tree = {"a": jnp.ones((3, 4)).at[0, 0].set(bad), "b": jnp.full(5, HUGE)}
    leaves, _, _ = _grouping.leaves_with_names(tree)
    grouping = _grouping.make_grouping(tree, "per_param")
    got = np.asarray(jax.jit(_grouping.group_norms, static_argnums=(1, 2))(leaves, grouping, p))
    assert np.isnan(got[0]) if math.isnan(bad) else got[0] == np.inf
    assert got[1] == pytest.approx(HUGE * 5 ** (1 / p), rel=1e-5)
    # ... and a clipper passes that group unchanged, the huge one scaled.
    tx = clipjax.normalize_per_param()
    out, _ = tx.update(tree, tx.init(tree))
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(tree["a"]))
    assert float(optax.tree.norm(out["b"])) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("case", ["clip_by_global_norm", "zclip", "agc"])
def test_an_ordinary_step_compiles_without_full_size_copies(case: str) -> None:
    compiled, _ = compiled_train_step(CASES[case].make())
    shapes = {(64, 64), (64,)}
    assert full_size_copies(compiled.as_text(), shapes) == 0

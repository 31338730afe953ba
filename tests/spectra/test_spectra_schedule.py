"""spectra's decay schedules of ``c`` after the warm-up, against a float64 restatement of
the paper's ``_get_current_clip_c`` (mlolab/llm-spectral-clipping, ``src/optim/spectra.py``).

The restatement, step by step: during the warm-up (``step < warmup_steps``) ``c *
lr(warmup_steps) / max(lr(step), 1e-10)``; after it ``c`` under ``"constant"``; else the
last ``n = int(fraction * total)`` steps of ``total`` decay, ``c`` before them, and in
them ``c * factor(min((step - (total - n)) / max(n, 1), 1))``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.spectra.test_spectra_rule import FLOAT32_BUDGET, exact, random_matrix, relative

DECAYS = ["linear", "sqrt", "cosine", "exp", "square"]
VECTOR_ONLY = {"b": jnp.ones(3)}  # no matrix: the thresholds alone, cheaply


def paper_c(
    step: int,
    c: float,
    decay: str = "constant",
    fraction: float = 0.1,
    final: float = 0.0,
    total: int = 0,
    warmup: int = 0,
    lr: Any = None,
) -> float:
    """``_get_current_clip_c`` restated in float64 (the wrapper's ``base_lr`` is ``lr(warmup)``)."""
    if warmup > 0 and step < warmup:
        return c * float(lr(warmup)) / max(float(lr(step)), 1e-10)
    if decay == "constant":
        return c
    anneal = int(fraction * total)
    hold = total - anneal
    if step < hold:
        return c
    p = min((step - hold) / max(anneal, 1), 1.0)
    if decay == "exp":
        return c * (final**p if final > 0 else 1 - p)
    weight = {
        "linear": 1 - p,
        "sqrt": 1 - math.sqrt(p),
        "cosine": (1 + math.cos(math.pi * p)) * 0.5,
        "square": 1 - p**2,
    }[decay]
    return c * (final + (1 - final) * weight)


def thresholds(tx: optax.GradientTransformation, count: int, tree: Any = None) -> np.ndarray:
    """The ``threshold`` metric of ``count`` steps, scanned under jit."""
    tree = VECTOR_ONLY if tree is None else tree

    def body(state, _):
        _, state = tx.update(tree, state)
        return state, clipjax.metrics(state)["spectra/global/threshold"]

    _, seen = jax.jit(lambda s: jax.lax.scan(body, s, None, length=count))(tx.init(tree))
    return np.asarray(seen, np.float64).reshape(count)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("final", [0.0, 0.1, 0.3, 0.7])
def test_each_decay_follows_the_papers_schedule(decay, final) -> None:
    kwargs = dict(decay=decay, fraction=0.25, final=final, total=40)
    tx = clipjax.spectra(2.0, decay=decay, decay_fraction=0.25, final_scale=final, total_steps=40)
    seen = thresholds(tx, 44)  # past the end, where p stays at 1
    want = [paper_c(k, 2.0, **kwargs) for k in range(44)]
    np.testing.assert_allclose(seen, want, rtol=1e-6, atol=1e-7)
    assert (seen[:30] == 2.0).all()  # held exactly until the last 10 steps
    assert seen[-1] == pytest.approx(2.0 * final, abs=1e-7)


def test_the_schedule_is_not_the_undecayed_one() -> None:
    # The negative control: the restatement with the decay off disagrees at every
    # decay step but the first, so the comparison above can fail.
    tx = clipjax.spectra(1.0, decay="linear", decay_fraction=0.5, final_scale=0.2, total_steps=20)
    seen = thresholds(tx, 20)
    constant = np.array([paper_c(k, 1.0) for k in range(20)])
    assert (np.abs(seen[11:] - constant[11:]) > 0.03).all()
    np.testing.assert_array_equal(seen[:11], constant[:11])


def test_the_decay_length_is_truncated_as_the_paper_truncates() -> None:
    # 0.29 * 100 is 28.999999999999996: int() makes the decay 28 steps, from step 72,
    # where rounding would make it 29, from step 71.
    assert int(0.29 * 100) == 28
    tx = clipjax.spectra(1.0, decay="linear", decay_fraction=0.29, final_scale=0.0, total_steps=100)
    seen = thresholds(tx, 101)
    want = [paper_c(k, 1.0, "linear", 0.29, 0.0, 100) for k in range(101)]
    np.testing.assert_allclose(seen, want, rtol=1e-6, atol=1e-7)
    assert seen[72] == 1.0 and seen[73] == pytest.approx(1 - 1 / 28, rel=1e-6)


def test_a_zero_fraction_decays_only_past_total_steps() -> None:
    # No decay steps: progress (step - total) / 1 is 0 at total_steps, 1 after.
    tx = clipjax.spectra(3.0, decay="cosine", decay_fraction=0.0, final_scale=0.5, total_steps=5)
    seen = thresholds(tx, 8)
    want = [paper_c(k, 3.0, "cosine", 0.0, 0.5, 5) for k in range(8)]
    np.testing.assert_allclose(seen, want, rtol=1e-6)
    np.testing.assert_allclose(seen, [3.0] * 6 + [1.5] * 2, rtol=1e-6)


@pytest.mark.parametrize("decay", ["linear", "exp"])
def test_the_warmup_takes_precedence_where_it_meets_the_decay(decay) -> None:
    # 10 steps decaying from step 5, a warm-up of 8: steps 0-7 hold c * lr, 8-9 decay.
    schedule = optax.linear_schedule(1e-4, 1e-3, 8)
    tx = clipjax.spectra(
        2.0,
        learning_rate=schedule,
        warmup_steps=8,
        decay=decay,
        decay_fraction=0.5,
        final_scale=0.25,
        total_steps=10,
    )
    seen = thresholds(tx, 12)
    want = [paper_c(k, 2.0, decay, 0.5, 0.25, 10, warmup=8, lr=schedule) for k in range(12)]
    np.testing.assert_allclose(seen, want, rtol=1e-5)
    assert seen[0] == pytest.approx(20.0, rel=1e-5) and seen[8] < 2.0


def test_the_exp_decay_with_a_zero_final_scale_is_linear_as_in_the_paper() -> None:
    make = functools.partial(clipjax.spectra, 1.0, final_scale=0.0, total_steps=8)
    exp = thresholds(make(decay="exp", decay_fraction=0.5), 10)
    linear = thresholds(make(decay="linear", decay_fraction=0.5), 10)
    np.testing.assert_array_equal(exp, linear)


def test_the_decayed_c_is_the_one_the_matrices_are_clipped_at() -> None:
    # At each step of the decay the float32 clip is the SVD rule at the paper's c there,
    # and not the rule at the undecayed c.
    u = random_matrix((24, 40), seed=7)
    sigma = float(np.linalg.norm(u, 2))
    kwargs = dict(decay="cosine", decay_fraction=0.5, final_scale=0.1, total_steps=6)
    tx = clipjax.spectra(sigma, dtype=jnp.float32, **kwargs)
    tree = {"w": jnp.asarray(u)}
    step = jax.jit(tx.update)
    state = tx.init(tree)
    for k in range(6):
        out, state = step(tree, state)
        c_k = paper_c(k, sigma, "cosine", 0.5, 0.1, 6)
        got = np.asarray(out["w"], np.float64)
        assert relative(got, exact(u, c_k)) < FLOAT32_BUDGET, k
        if k >= 4:
            assert relative(got, exact(u, sigma)) > 100 * FLOAT32_BUDGET, k


def test_a_decay_to_zero_gives_zero_updates_and_a_sound_state() -> None:
    tree = {"w": jnp.asarray(random_matrix((6, 10), seed=8)), "b": jnp.linspace(-1.0, 1.0, 10)}
    tx = clipjax.spectra(
        1.0, apply_to="all", decay="linear", decay_fraction=0.5, final_scale=0.0, total_steps=4
    )
    step = jax.jit(tx.update)
    state = tx.init(tree)
    for _ in range(4):
        out, state = step(tree, state)
        chex.assert_tree_all_finite(out)
    out, state = step(tree, state)  # step 4 = total_steps: c = 0
    m = clipjax.metrics(state)
    assert float(m["spectra/global/threshold"]) == 0.0
    for leaf in jax.tree.leaves(out):
        np.testing.assert_array_equal(leaf, np.zeros(leaf.shape))
    assert bool(m["spectra/global/clipped"]) and int(m["spectra/global/nonfinite_count"]) == 0
    assert float(m["spectra/global/sigma_bound"]) > 0


def test_the_default_and_an_explicit_constant_decay_are_the_plain_rule() -> None:
    tree = {"w": jnp.asarray(random_matrix((6, 10), seed=9))}
    plain, constant = clipjax.spectra(0.5), clipjax.spectra(0.5, decay="constant")
    got, _ = constant.update(tree, constant.init(tree))
    want, _ = plain.update(tree, plain.init(tree))
    chex.assert_trees_all_equal(got, want)


def test_an_injected_c_decays_as_the_plain_factory() -> None:
    kwargs = dict(decay="sqrt", decay_fraction=0.5, final_scale=0.2, total_steps=6)
    static = ("dtype", "decay_fraction", "final_scale", "total_steps")
    injected = optax.inject_hyperparams(clipjax.spectra, static_args=static)(
        c=1.5, dtype=jnp.float32, **kwargs
    )
    plain = clipjax.spectra(1.5, dtype=jnp.float32, **kwargs)
    tree = {"w": jnp.asarray(random_matrix((5, 7), seed=10))}

    def run(tx):
        state, outs = tx.init(tree), []
        for _ in range(7):
            out, state = tx.update(tree, state)
            outs.append(out["w"])
        return jnp.stack(outs), state

    got, got_state = jax.jit(lambda: run(injected))()
    want, want_state = jax.jit(lambda: run(plain))()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got_state.inner_state.metrics, want_state.metrics, rtol=1e-6)
    assert float(clipjax.metrics(got_state)["spectra/global/threshold"]) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(decay="step"), "decay must be one of"),
        (dict(decay="linear"), "decay='linear' needs total_steps"),
        (dict(decay="linear", total_steps=0), "total_steps must be an int >= 1"),
        (dict(decay="linear", total_steps=10.0), "total_steps must be an int >= 1"),
        (dict(decay="linear", total_steps=10, decay_fraction=1.5), r"decay_fraction must be in"),
        (dict(decay="linear", total_steps=10, decay_fraction=-0.1), r"decay_fraction must be in"),
        (dict(decay="linear", total_steps=10, final_scale=-0.5), "final_scale must be >= 0"),
        (dict(decay="linear", total_steps=10, final_scale=math.nan), "final_scale must be >= 0"),
        (
            dict(decay="linear", total_steps=10, final_scale=jnp.asarray(0.5)),
            "final_scale fixes shapes or Python control flow",
        ),
        (dict(total_steps=10), "total_steps shape a decay of c; pass decay="),
        (dict(decay_fraction=0.2, final_scale=0.1), "decay_fraction, final_scale shape a decay"),
    ],
)
def test_bad_decay_arguments_are_refused_naming_them(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        clipjax.spectra(1.0, **kwargs)

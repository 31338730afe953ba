"""First, do no harm: zclip's start rule (SPEC 9.8). ``start="hold"`` holds the warm-up's
steps: ``clipjax.chain`` and ``skip_on_spike`` around one skip the optimizer on them, so
adam's step is never enlarged (0.4's time weight, the negative control, enlarged it by up
to 42% at step 25), measured on ``benchmarks/start.py``'s stationary stream."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import start

WARMUP = 25


@pytest.fixture(scope="module")
def boosts() -> dict[str, start.Boost]:
    return {name: start.boost(code, route) for name, (code, route) in start.CANDIDATES.items()}


def test_the_recommended_route_never_enlarges_adams_step(boosts) -> None:
    for name in ("hold, in clipjax.chain", "hold, in skip_on_spike(clipjax.chain)"):
        b = boosts[name]
        assert start.meets(b, "optimizer"), (name, b)
        assert (b.held == WARMUP).all()
        assert (b.opt_max <= start.MAX_RATIO).all() and (np.abs(b.opt_mean - 1) <= 0.03).all()


def test_0_4s_time_weight_enlarges_it() -> None:
    """The negative control: 1.42-1.50x at its worst, 1.10x on average."""
    b = start.boost(*start.CANDIDATES["0.4: time weight"])
    assert not start.meets(b, "optimizer")
    assert (b.opt_max > 1.3).all() and (b.opt_mean > 1.05).all()


def test_what_optax_chain_gets(boosts) -> None:
    """Through optax.chain the held steps reach adam: the first zeroed (a deficit of
    one step), the rest bounded by the warm-up ceiling: at most 1.06x, never 0.4's."""
    b = boosts["hold, in optax.chain"]
    assert (b.held == 1).all()
    assert (b.opt_max <= 1.08).all() and (b.opt_mean <= 1.03).all()


@pytest.mark.parametrize("wrap", ["chain", "skip_on_spike", "inject_hyperparams"])
def test_held_steps_leave_the_optimizer_untouched(wrap: str) -> None:
    clipper = clipjax.zclip(feedback="clipped", warmup_steps=5)
    if wrap == "inject_hyperparams":
        clipper = optax.inject_hyperparams(clipjax.zclip)(feedback="clipped", warmup_steps=5)
    tx = clipjax.chain(clipper, clipjax.adam(1e-2))
    if wrap == "skip_on_spike":
        tx = clipjax.skip_on_spike(tx)
    params = {"w": jnp.zeros(16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    grads = start.stream(0, steps=8, dim=16)
    for step, g in enumerate(grads):
        out, state = update({"w": jnp.asarray(g)}, state, params)
        held = bool(clipjax.metrics(state)["zclip/global/held"])
        assert held == (step < 5)
        adam = optax.tree_utils.tree_get(state, "ScaleByAdamState")
        assert int(adam.count) == max(0, step - 4)
        if held:
            np.testing.assert_array_equal(out["w"], np.zeros(16))
            np.testing.assert_array_equal(adam.nu["w"], np.zeros(16))
    # The optimizer's first step is adam's first step on the first step it took.
    alone = optax.adam(1e-2)
    want, _ = alone.update({"w": jnp.asarray(grads[5])}, alone.init(params))
    first = clipjax.chain(clipjax.zclip(feedback="clipped", warmup_steps=5), clipjax.adam(1e-2))
    s = first.init(params)
    for g in grads[:6]:
        got, s = first.update({"w": jnp.asarray(g)}, s, params)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)


def test_through_optax_chain_the_first_step_is_zeroed_and_the_rest_bounded() -> None:
    norms = np.array([15.0, 13.0, 8.0, 30.0, 2.0, 1.0, 0.9, 1.1])
    tx = clipjax.zclip(feedback="clipped", warmup_steps=6)
    state = tx.init({"w": jnp.zeros(1)})
    low = np.inf
    for step, g in enumerate(norms):
        out, state = tx.update({"w": jnp.array([g], jnp.float32)}, state)
        bound = 0.0 if step == 0 else min(g, 1.5 * low)
        assert float(out["w"][0]) == pytest.approx(bound, rel=1e-6), step
        assert bool(clipjax.metrics(state)["zclip/global/held"]) == (step < 6)
        low = min(low, g)


def test_start_is_checked_and_off_by_default() -> None:
    with pytest.raises(ValueError, match="start must be one of"):
        clipjax.zclip(feedback="clipped", start="ramp")
    m = clipjax.metrics(clipjax.zclip().init({"w": jnp.zeros(2)}))
    assert "zclip/global/held" not in m and "zclip/global/weight" not in m


def test_the_hold_costs_no_bytes_and_no_copy_in_clipjax_chain() -> None:
    """adamw's skip of a held step is folded into its loops as selects: the compiled
    step accesses the bytes of the same clipper in optax.chain, with no full-size copy
    and no full-size conditional (optax.adamw inside clipjax.chain runs under one)."""
    from tests import compiled_step as C

    shapes = {(64, 64), (64,)}
    step = lambda chain, opt: C.compiled_train_step(chain(clipjax.zclip(feedback="clipped"), opt))[
        0
    ]
    plain, held = step(optax.chain, optax.adamw(1e-3)), step(clipjax.chain, clipjax.adamw(1e-3))
    text = held.as_text()
    assert C.full_size_copies(text, shapes) == 0 and C.full_size_conditionals(text, shapes) == 0
    assert C.bytes_accessed(held) <= C.bytes_accessed(plain) * 1.001
    cond = step(clipjax.chain, optax.adamw(1e-3))
    assert C.full_size_conditionals(cond.as_text(), shapes) == 1

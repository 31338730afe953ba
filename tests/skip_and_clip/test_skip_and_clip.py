"""``skip_and_clip_by_global_norm`` against a float64 restatement of AXLearn's code.

The restatement (``tests/restate/skip_and_clip.py``) follows apple/axlearn at
34aed43c1b6e581c4753d06d7cbeedd5010ef26b, ``axlearn/common/optimizers.py``;
``fix=True`` adds clipjax's documented changes. Error budget: float32 clipjax
against float64, relative 3e-5 on the norm, the drop threshold, the clip scale
and the EMA mean, 1e-4 on the EMA std (measured below 1e-5); the decisions and
every counter exact. The inner optimizer's state is skipped exactly: parameters
equal those of ``optax.adam`` applied on the taken steps only. Negative
controls: another decay, another feedback, the unfixed code where clipjax fixes it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import references as R
from tests import restate as S
from tests.compiled_step import compiled_train_step, full_size_conditionals, full_size_copies
from tests.restate import skip_and_clip as A
from tests.skip_streams import directions, tree_equal

PREFIX = "skip_and_clip_by_global_norm/global/"
N = 400
SPIKY, _ = R.spikes(N, 5)  # x10, x100, x1000, x30 at 120, 187, 253, 320
WITH_NAN = R.with_nan(R.with_nan(SPIKY, [60, 61]), [200], math.inf)
SHIFT = np.r_[SPIKY[:200], 40.0 * SPIKY[200:]]  # a lasting x40 rise

RULES = {  # name: (clipjax's drop_norm, the restatement's)
    "ema": (lambda: clipjax.drop_norm_by_grad_norm_ema(), lambda: A.ema_rule()),
    "ema_small": (lambda: clipjax.drop_norm_by_grad_norm_ema((2, 5, 8)),
                  lambda: A.ema_rule((2, 5, 8))),
    "stddev": (lambda: clipjax.drop_norm_by_grad_norm_stddev(min_count=50, multipliers=(6, 10, 20)),
               lambda: A.stddev_rule(50, (6, 10, 20))),
    "fixed": (lambda: 5.0, lambda: 5.0),
    "none": (lambda: None, lambda: None),
}  # fmt: skip


def run(norms: np.ndarray, **kwargs: Any) -> dict[str, np.ndarray]:
    tx = clipjax.skip_and_clip_by_global_norm(optax.sgd(0.1), **kwargs)
    got, _, _ = S.run_tree(tx, np.asarray(norms)[:, None], S.flat_tree)
    return got


def compare(got: dict, want: dict, fields: Any = None) -> None:
    fields = [f for f in want if f not in ("mean", "std")] if fields is None else fields
    S.compare(got, want, PREFIX, fields)
    if "mean" in want:
        S.compare(got, want, PREFIX, ["mean"])
        S.compare(got, want, PREFIX, ["std"], rtol=1e-4, atol=1e-6)


# Every rule with and without the clip (no rule and no clip is refused at construction).
TRACE_CASES = [(r, m) for r in sorted(RULES) for m in (None, 1.0) if (r, m) != ("none", None)]


@pytest.mark.parametrize(("rule", "max_norm"), TRACE_CASES)
def test_trace_equals_axlearn(rule: str, max_norm: float | None) -> None:
    """AXLearn's published code on finite norms, clipjax's fix with NaN and inf."""
    ours, theirs = RULES[rule]
    decay = 0.99 if rule != "stddev" else 0.95
    kw = dict(max_norm=max_norm)
    if callable(theirs()):
        kw["grad_norm_ema_decay"] = decay
    got = run(SPIKY, drop_norm=ours(), **kw)
    # Finite norms, the first one below the thresholds: the published code itself.
    want = A.skip_and_clip(SPIKY, drop_norm=theirs(), decay=decay, max_norm=max_norm, fix=False)
    compare(got, want)
    if rule != "none":
        assert want["skipped"].any()  # the trace exercises the rule
    # With NaN and inf: clipjax's documented fix.
    got = run(WITH_NAN, drop_norm=ours(), **kw)
    want = A.skip_and_clip(WITH_NAN, drop_norm=theirs(), decay=decay, max_norm=max_norm)
    compare(got, want)


@pytest.mark.parametrize("feedback", ["raw", "clipped"])
def test_other_feedbacks_equal_their_restatement(feedback: str) -> None:
    for norms in (WITH_NAN, SHIFT):
        got = run(norms, drop_norm=RULES["ema_small"][0](), grad_norm_ema_decay=0.9,
                  feedback=feedback)  # fmt: skip
        compare(got, A.skip_and_clip(norms, drop_norm=A.ema_rule((2, 5, 8)), decay=0.9,
                                     feedback=feedback))  # fmt: skip


def test_a_lasting_rise_is_dropped_for_good_under_skip_and_learnt_under_clipped() -> None:
    kw = dict(drop_norm=clipjax.drop_norm_by_grad_norm_ema((2, 5, 8)), grad_norm_ema_decay=0.9)
    skip = run(SHIFT, **kw)
    assert skip[PREFIX + "skipped"][200:].all()  # AXLearn's rule stalls
    clipped = run(SHIFT, feedback="clipped", **kw)
    # The EMA climbs x1.1 a step at the boundary (2 x mean): the x40 level is learnt
    # within about 40 steps; later only the spikes (x1000 at 253, x30 at 320) drop.
    assert set(np.nonzero(clipped[PREFIX + "skipped"][235:])[0] + 235) == {253, 320}


def test_negative_controls_are_far_over_the_budget() -> None:
    got = run(SPIKY, drop_norm=clipjax.drop_norm_by_grad_norm_stddev(min_count=50),
              grad_norm_ema_decay=0.95)  # fmt: skip
    for kw in ({"decay": 0.9}, {"decay": 0.95, "feedback": "raw"}):
        want = A.skip_and_clip(SPIKY, drop_norm=A.stddev_rule(50), fix=False, **kw)
        ok = np.isfinite(want["drop_norm"]) & (want["drop_norm"] < 1e9)
        error = np.max(np.abs(got[PREFIX + "drop_norm"][ok] / want["drop_norm"][ok] - 1))
        assert error > 100 * S.RTOL, kw


def test_fix_axlearn_drops_every_step_of_a_run_whose_first_norms_reach_20() -> None:
    """**FIX**: AXLearn's EMAs start at 1, so 20x_mean judges the first step at 20; a run
    whose norms start at 50 is dropped at its first step, its EMA never moves (only taken
    steps are observed), and every later step is dropped too."""
    norms = 50.0 * SPIKY[:100] / SPIKY[:100].max() + 25.0
    theirs = A.skip_and_clip(norms, drop_norm=A.ema_rule(), decay=0.99, fix=False)
    assert theirs["skipped"].all()
    got = run(norms, drop_norm=clipjax.drop_norm_by_grad_norm_ema(), grad_norm_ema_decay=0.99)
    assert not got[PREFIX + "skipped"].any()
    compare(got, A.skip_and_clip(norms, drop_norm=A.ema_rule(), decay=0.99))


def test_fix_axlearn_float32_stddev_turns_nan_and_drops_steady_steps() -> None:
    """**FIX**: ``(m2 - mean**2) ** 0.5`` in float32 is NaN once the norms barely move
    (here 1e-4 relative noise), and ``g < NaN`` drops the step."""
    rng = np.random.default_rng(0)
    norms = 1.0 + 1e-4 * rng.standard_normal(300)
    rule = A.stddev_rule(20, (6,))
    theirs = A.skip_and_clip(norms, drop_norm=rule, decay=0.99, fix=False, dtype=np.float32)
    assert theirs["skipped"][20:].sum() > 20 and np.isnan(theirs["std"]).any()
    got = run(norms, drop_norm=clipjax.drop_norm_by_grad_norm_stddev(min_count=20,
              multipliers=(6,)), grad_norm_ema_decay=0.99)  # fmt: skip
    assert got[PREFIX + "skipped"].sum() < 5 and np.isfinite(got[PREFIX + "std"]).all()


def test_fix_a_nan_norm_is_not_counted_against_every_threshold() -> None:
    norms = R.with_nan(SPIKY[:100], [50])
    theirs = A.skip_and_clip(norms, drop_norm=A.ema_rule(), decay=0.99, fix=False)
    assert theirs["count_exceeds_20x_mean"][-1] == 1  # AXLearn: the NaN "exceeds" 20x
    got = run(norms, drop_norm=clipjax.drop_norm_by_grad_norm_ema(), grad_norm_ema_decay=0.99)
    assert got[PREFIX + "count_exceeds_20x_mean"][-1] == 0
    assert got[PREFIX + "nonfinite_count"][-1] == 1 and got[PREFIX + "skipped_count"][-1] == 1


INNERS = {
    "fold": lambda: clipjax.adam(1e-2),
    "cond": lambda: optax.adam(1e-2),
    "chain_fold": lambda: clipjax.chain(clipjax.clip_by_global_norm(0.8), clipjax.adam(1e-2)),
}


@pytest.mark.filterwarnings("ignore::clipjax.ConditionalRouteWarning")
@pytest.mark.parametrize("route", sorted(INNERS))
def test_a_dropped_step_leaves_the_inner_state_and_the_params(route: str) -> None:
    """Against optax.adam applied on the restatement's taken steps, on its clipped grads."""
    norms = WITH_NAN[:150]
    grads = [{k: v * np.float32(n) for k, v in d.items()} for d, n in zip(directions(150), norms)]
    params = {k: jnp.zeros(v.shape) for k, v in grads[0].items()}
    rule = clipjax.drop_norm_by_grad_norm_ema((2, 5, 8))
    tx = clipjax.skip_and_clip_by_global_norm(
        INNERS[route](), drop_norm=rule, max_norm=1.0, grad_norm_ema_decay=0.9
    )
    assert tx.route == ("cond" if route == "cond" else "fold") or tx.route is None
    want = A.skip_and_clip(norms, drop_norm=A.ema_rule((2, 5, 8)), decay=0.9, max_norm=1.0)
    reference = (
        INNERS["cond"]()
        if route != "chain_fold"
        else optax.chain(optax.clip_by_global_norm(0.8), optax.adam(1e-2))
    )
    ours, theirs = params, params
    state, ref_state = tx.init(params), reference.init(params)
    update = jax.jit(tx.update)
    for t, g in enumerate(grads):
        g = {k: jnp.asarray(v) for k, v in g.items()}
        updates, state = update(g, state, ours)
        ours = optax.apply_updates(ours, updates)
        if not want["skipped"][t]:
            scaled = jax.tree.map(lambda x, s=want["scale"][t]: x * np.float32(s), g)
            ref_updates, ref_state = reference.update(scaled, ref_state, theirs)
            theirs = optax.apply_updates(theirs, ref_updates)
        else:
            assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    assert want["skipped"].sum() >= 3
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    assert tx.route == ("cond" if route == "cond" else "fold")


def test_the_fold_route_compiles_to_no_conditional_and_no_copy() -> None:
    tx = clipjax.skip_and_clip_by_global_norm(
        clipjax.adamw(1e-3), drop_norm=clipjax.drop_norm_by_grad_norm_ema(), max_norm=1.0,
        grad_norm_ema_decay=0.99,
    )  # fmt: skip
    compiled, _ = compiled_train_step(_without_value(tx))
    text = compiled.as_text()
    assert full_size_copies(text, {(64, 64), (64,)}) == 0
    assert full_size_conditionals(text, {(64, 64), (64,)}) == 0


def _without_value(tx: Any) -> Any:
    """compiled_train_step passes value=loss: skip_and_clip hands extra args to inner."""
    return optax.GradientTransformationExtraArgs(
        tx.init, lambda u, s, p=None, value=None, **kw: tx.update(u, s, p, **kw)
    )


def test_update_if_false_of_the_inner_and_a_skipped_step_are_bit_identical() -> None:
    tx = clipjax.skip_and_clip_by_global_norm(clipjax.adamw(1e-3), drop_norm=3.0)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full(3, 0.5)}, state, params)
    updates, new = tx.update({"w": jnp.full(3, 10.0)}, state, params)
    assert tree_equal(new.inner_state, state.inner_state)
    assert float(jnp.abs(updates["w"]).max()) == 0
    assert bool(new.metrics["skipped"][0]) and int(new.metrics["count_exceeds_drop_norm"][0]) == 1


def test_metrics_of_the_inner_clippers_read_skipped_on_a_dropped_step() -> None:
    inner = clipjax.chain(clipjax.clip_by_global_norm(1.0), clipjax.adam(1e-3))
    tx = clipjax.skip_and_clip_by_global_norm(inner, drop_norm=3.0)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full(4, 0.4)}, state, params)
    _, state = tx.update({"w": jnp.full(4, 10.0)}, state, params)
    m = clipjax.metrics(state)
    assert np.isnan(float(m["clip_by_global_norm/global/grad_norm"]))
    assert bool(m["clip_by_global_norm/global/skipped"])
    assert float(m[PREFIX + "grad_norm"]) == 20.0 and bool(m[PREFIX + "skipped"])


def test_scan_carry_single_trace_donation_and_wrappers() -> None:
    tx = clipjax.skip_and_clip_by_global_norm(
        clipjax.adamw(1e-3), drop_norm=clipjax.drop_norm_by_grad_norm_stddev(min_count=2),
        max_norm=1.0, grad_norm_ema_decay=0.9,
    )  # fmt: skip
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    traces = []

    def step(state: Any, i: jax.Array) -> Any:
        traces.append(1)
        grads = jax.tree.map(lambda p: p + 0.1 * i, params)
        _, state = tx.update(grads, state, params)
        return state, None

    state, _ = jax.lax.scan(step, tx.init(params), jnp.arange(10.0))
    assert len(traces) == 1
    assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
    update = jax.jit(tx.update, donate_argnums=(1,))
    state = tx.init(params)
    for _ in range(3):
        _, state = update(params, state, params)
    for wrapped in (
        optax.MultiSteps(tx, 2),
        optax.chain(optax.identity(), tx),
        optax.apply_if_finite(tx, 3),
    ):
        s = wrapped.init(params)
        for _ in range(3):
            _, s = jax.jit(wrapped.update)(params, s, params)
        assert PREFIX + "count_exceeds_20x_stddev" in clipjax.metrics(s)


EMA, STDDEV = clipjax.drop_norm_by_grad_norm_ema, clipjax.drop_norm_by_grad_norm_stddev
BAD = [({"drop_norm": 0.0}, "drop_norm"), ({"drop_norm": "ema"}, "drop_norm"),
       ({"drop_norm": lambda count, mean, stddev: {}}, "drop_norm"),
       ({"drop_norm": lambda x: {"a": x}}, "drop_norm"),
       ({"drop_norm": EMA()}, "grad_norm_ema_decay"),
       ({"drop_norm": 5.0, "grad_norm_ema_decay": 1.0}, "grad_norm_ema_decay"),
       ({"max_norm": -1.0}, "max_norm"), ({"eps": -1.0}, "eps"),
       ({"feedback": "clip_target"}, "feedback"), ({"name": ""}, "name")]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "argument"), BAD)
def test_bad_arguments_are_named(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        clipjax.skip_and_clip_by_global_norm(optax.sgd(0.1), **kwargs)


def test_neither_drop_norm_nor_max_norm_is_refused_naming_both() -> None:
    """With both None no finite step is dropped or clipped: a x1000 spike went through."""
    with pytest.raises(ValueError, match=r"drop_norm and max_norm are both None"):
        clipjax.skip_and_clip_by_global_norm(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"^mine: drop_norm and max_norm"):
        clipjax.skip_and_clip_by_global_norm(clipjax.adamw(1e-3), drop_norm=None, name="mine")
    # Either one alone is a working configuration.
    clipjax.skip_and_clip_by_global_norm(optax.sgd(0.1), drop_norm=5.0)
    clipjax.skip_and_clip_by_global_norm(optax.sgd(0.1), max_norm=1.0)


@pytest.mark.parametrize(("make", "argument"), [
    (lambda: EMA(()), "multipliers"), (lambda: EMA((20, -1)), "multipliers"),
    (lambda: STDDEV(min_count=-1), "min_count"), (lambda: STDDEV(multipliers=(0,)), "multipliers"),
])  # fmt: skip
def test_bad_rule_arguments_are_named(make: Any, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        make()


def test_inner_must_be_a_transform_and_the_tree_must_match() -> None:
    with pytest.raises(TypeError, match="inner"):
        clipjax.skip_and_clip_by_global_norm(optax.adam)
    tx = clipjax.skip_and_clip_by_global_norm(clipjax.adamw(1e-3), drop_norm=5.0)
    state = tx.init({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="does not match"):
        tx.update({"w": jnp.ones(4)}, state, {"w": jnp.ones(4)})
    int_tree = {"w": jnp.ones(3, jnp.int32)}
    with pytest.raises(ValueError, match="integer"):
        tx.update(int_tree, tx.init(int_tree))

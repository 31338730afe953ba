"""``spam``, ``stable_spam``, ``adaclip`` and ``ada_norm`` against pytorch-optimizer's
``SPAM`` and ``StableSPAM`` (parameters at float32 tolerance after every step), the
reference bugs fixed here (each shown on the reference), and NaN elements against the
float64 restatements (``tests/restate/spam.py``). Without a reference: test_spam_pieces.py.
"""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.references.spam import have_pytorch_optimizer, run_reference, spiky_gradients
from tests.restate.spam import restate_spam, restate_stable_spam

SHAPES = {"w": (4, 3), "b": (3,)}
PARAMS = {
    "w": np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3),
    "b": np.full(3, 0.5, np.float32),
}
# Parameters of order 1 after up to 80 float32 steps: a few ulp per step.
ATOL = 2e-5

needs_reference = pytest.mark.skipif(
    not have_pytorch_optimizer(), reason="needs torch and pytorch-optimizer"
)


def run_ours(tx: Any, grads: list[dict[str, np.ndarray]], params: Any = None) -> list[Any]:
    """``(params, state)`` after every step, one compiled step."""
    params = {k: jnp.asarray(v) for k, v in (PARAMS if params is None else params).items()}
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    out = []
    for g in grads:
        params, state = step(params, state, {k: jnp.asarray(v) for k, v in g.items()})
        out.append(jax.device_get((params, state)))
    return out


def assert_trace_close(ours: list[Any], reference: list[dict[str, np.ndarray]], atol=ATOL):
    for t, ((params, _), expected) in enumerate(zip(ours, reference)):
        for k in expected:
            np.testing.assert_allclose(
                params[k], expected[k], rtol=0, atol=atol, err_msg=f"{t} {k}"
            )


SPAM_CASES = {
    # Two resets (steps 20 and 40) with their warm-ups, clipping from step 3.
    "two_resets": (
        dict(reset_interval=20, warmup_steps=5, clip_delay=3),
        dict(update_proj_gap=20, warmup_epoch=5, grad_accu_steps=3),
        dict(spikes={30: 100.0}, element_spikes={25: 1e3, 45: 1e4}),
        60,
    ),
    # The defaults but the reset interval, a spike before the clip starts.
    "defaults": (
        dict(reset_interval=25),
        dict(update_proj_gap=25),
        dict(spikes={10: 50.0, 35: 100.0}, element_spikes={45: 1e3, 71: 1e4}),
        80,
    ),
    # Decoupled weight decay, a small threshold (many clipped elements).
    "weight_decay": (
        dict(weight_decay=0.1, threshold=3.0, reset_interval=15, warmup_steps=4, clip_delay=2),
        dict(weight_decay=0.1, threshold=3, update_proj_gap=15, warmup_epoch=4, grad_accu_steps=2),
        dict(spikes={20: 30.0}),
        50,
    ),
}


@needs_reference
@pytest.mark.parametrize("case", sorted(SPAM_CASES))
def test_spam_matches_pytorch_optimizer(case: str) -> None:
    ours_kw, ref_kw, spikes, steps = SPAM_CASES[case]
    lr = 1e-3 if "weight_decay" in ours_kw else 1e-2
    grads = spiky_gradients(SHAPES, steps, seed=len(case), **spikes)
    reference = run_reference("SPAM", PARAMS, grads, lr=lr, **ref_kw)
    ours = run_ours(clipjax.spam(lr, **ours_kw), grads)
    # The weight decay differs by lr * weight_decay * update per step (the
    # reference decays the updated parameter): below 1e-7 per step here.
    assert_trace_close(ours, reference)
    metrics = clipjax.metrics(ours[-1][1])
    assert int(metrics["spam/global/resets"]) == steps // ours_kw["reset_interval"]
    clipped = [float(clipjax.metrics(s)["spam/global/clipped_fraction"]) for _, s in ours]
    assert max(clipped) > 0


def torch_warmup(death_steps: int, steps: int) -> list[float]:
    """``1 - CosineDecay(0.99, W).get_death_rate(c)`` for ``c`` in ``range(steps)``."""
    from pytorch_optimizer.optimizer.spam import CosineDecay

    decay = CosineDecay(0.99, death_steps)
    return [1.0 - decay.get_death_rate(c) for c in range(steps)]


@needs_reference
def test_spam_metrics_say_what_the_step_did() -> None:
    """Warm-up factors are torch's CosineDecay's; the clipped share is counted."""
    grads = spiky_gradients(SHAPES, 30, element_spikes={22: 1e4})
    ours = run_ours(clipjax.spam(1e-2, reset_interval=10, warmup_steps=4, clip_delay=1), grads)
    metrics = [clipjax.metrics(s) for _, s in ours]
    warm = [float(m["spam/global/warmup_scale"]) for m in metrics]
    since = [int(m["spam/global/steps_since_reset"]) for m in metrics]
    resets = [int(m["spam/global/resets"]) for m in metrics]
    assert warm[:9] == [1.0] * 9  # no warm-up before the first reset (step 10)
    np.testing.assert_allclose(warm[9:14], torch_warmup(4, 5), rtol=1e-6)
    assert warm[14:19] == [1.0] * 5
    assert since[8:12] == [8, 0, 1, 2] and since[19] == 0
    assert resets[8:11] == [0, 1, 1] and resets[-1] == 3
    # Step 23 (index 22): every leaf's first element spikes by 1e4, nothing else.
    assert float(metrics[22]["spam/global/clipped_fraction"]) == pytest.approx(2 / 15)


@needs_reference
def test_spam_nan_element_is_fixed_and_the_rest_matches() -> None:
    """**FIX**: the reference's NaN element stays NaN; ours keeps its moments."""
    grads = spiky_gradients(SHAPES, 40, nonfinite={12: np.nan, 30: np.inf})
    kw = dict(reset_interval=20, warmup_steps=5, clip_delay=3)
    reference = run_reference(
        "SPAM", PARAMS, grads, lr=1e-2, update_proj_gap=20, warmup_epoch=5, grad_accu_steps=3
    )
    ours = run_ours(clipjax.spam(1e-2, **kw), grads)
    # The reference: element w[0, 0] is NaN from step 12 on (SPAM is element-wise).
    assert np.isnan(reference[-1]["w"][0, 0]) and np.isfinite(reference[-1]["w"]).sum() == 11
    for params, state in ours:
        chex.assert_tree_all_finite((params, state))
    mask = np.ones(SHAPES["w"], bool)
    mask[0, 0] = False
    for t, ((params, _), expected) in enumerate(zip(ours, reference)):
        np.testing.assert_allclose(params["w"][mask], expected["w"][mask], atol=ATOL, err_msg=t)
        np.testing.assert_allclose(params["b"], expected["b"], atol=ATOL, err_msg=t)
    # The NaN step left the element's moments as they were.
    (_, before), (_, after) = ours[11], ours[12]
    assert before[0][0].mu["w"][0, 0] == after[0][0].mu["w"][0, 0]
    assert before[0][0].nu["w"][0, 0] == after[0][0].nu["w"][0, 0]
    assert int(clipjax.metrics(ours[-1][1])["spam/global/nonfinite_count"]) == 2


@needs_reference
def test_spam_zero_second_moment_is_not_clipped_to_zero() -> None:
    """**FIX**: an element that only saw zeros is frozen by the reference, not here."""
    grads = spiky_gradients(SHAPES, 40)
    for g in grads[:25]:
        g["w"][1, 1] = 0.0  # an unused element, as an embedding row of a rare token
    reference = run_reference("SPAM", PARAMS, grads, lr=1e-2, update_proj_gap=100)
    ours = run_ours(clipjax.spam(1e-2, reset_interval=100), grads)
    start = PARAMS["w"][1, 1]
    assert all(r["w"][1, 1] == start for r in reference)  # clipped to 0, forever
    assert ours[-1][0]["w"][1, 1] != start
    mask = np.ones(SHAPES["w"], bool)
    mask[1, 1] = False
    for (params, _), expected in zip(ours, reference):
        np.testing.assert_allclose(params["w"][mask], expected["w"][mask], atol=ATOL)


STABLE_CASES = {
    "two_resets": (
        dict(reset_interval=20),
        dict(update_proj_gap=20),
        dict(spikes={30: 100.0}, element_spikes={25: 1e3, 45: 1e4}),
        60,
    ),
    "weight_decay_and_gammas": (
        dict(reset_interval=15, weight_decay=0.1, gamma1=0.8, gamma2=0.95, theta=0.99),
        dict(update_proj_gap=15, weight_decay=0.1, gamma1=0.8, gamma2=0.95, theta=0.99),
        dict(spikes={10: 20.0, 33: 1e3}, element_spikes={20: 1e3}),
        50,
    ),
}


@needs_reference
@pytest.mark.parametrize("case", sorted(STABLE_CASES))
def test_stable_spam_matches_pytorch_optimizer(case: str) -> None:
    ours_kw, ref_kw, spikes, steps = STABLE_CASES[case]
    grads = spiky_gradients(SHAPES, steps, seed=7, **spikes)
    reference = run_reference("StableSPAM", PARAMS, grads, lr=1e-2, **ref_kw)
    ours = run_ours(clipjax.stable_spam(1e-2, **ours_kw), grads)
    assert_trace_close(ours, reference)
    metrics = clipjax.metrics(ours[-1][1])
    assert int(metrics["stable_spam/global/resets"]) == steps // ours_kw["reset_interval"]
    fractions = [float(clipjax.metrics(s)["adaclip/w/clipped_fraction"]) for _, s in ours]
    assert max(fractions) > 0
    # Without AdaClip's count: the same trace, the same metrics less the fraction.
    uncounted = run_ours(clipjax.stable_spam(1e-2, count_clipped=False, **ours_kw), grads)
    assert_trace_close(uncounted, reference)
    counted, fewer = metrics, clipjax.metrics(uncounted[-1][1])
    assert {k for k in counted if k not in fewer} == {f"adaclip/{k}/clipped_fraction" for k in "bw"}
    chex.assert_trees_all_equal(fewer, {k: counted[k] for k in fewer})


@needs_reference
@pytest.mark.parametrize("kind", ["SPAM", "StableSPAM"])
def test_a_nan_step_around_skip_on_spike_is_the_reference_without_it(kind: str) -> None:
    """The reference is poisoned by the NaN step; skipped, ours equals it without that step."""
    grads = spiky_gradients(SHAPES, 45, nonfinite={17: np.nan})
    without = grads[:17] + grads[18:]
    if kind == "SPAM":
        ref_kw = dict(update_proj_gap=20, warmup_epoch=5, grad_accu_steps=3)
        inner = clipjax.spam(1e-2, reset_interval=20, warmup_steps=5, clip_delay=3)
    else:
        ref_kw = dict(update_proj_gap=20)
        inner = clipjax.stable_spam(1e-2, reset_interval=20)
    poisoned = run_reference(kind, PARAMS, grads, lr=1e-2, **ref_kw)
    assert np.isnan(poisoned[-1]["w"]).any()
    reference = run_reference(kind, PARAMS, without, lr=1e-2, **ref_kw)
    # sigma so large that only the non-finite step is skipped.
    ours = run_ours(clipjax.skip_on_spike(inner, sigma=1e30), grads)
    skipped = [bool(s.metrics["skipped"][0]) for _, s in ours]
    assert skipped == [t == 17 for t in range(45)]
    assert_trace_close(ours[:17] + ours[18:], reference)


@needs_reference
def test_stable_spam_nan_keeps_every_statistic_finite() -> None:
    """**FIX**: the reference's AdaClip and AdaGN EMAs turn NaN; ours leave the element out."""
    grads = spiky_gradients(SHAPES, 30, nonfinite={10: np.nan, 20: np.inf})
    reference = run_reference("StableSPAM", PARAMS, grads, lr=1e-2, update_proj_gap=12)
    assert np.isnan(reference[-1]["w"]).all() and np.isfinite(reference[-1]["b"]).all()
    ours = run_ours(clipjax.stable_spam(1e-2, reset_interval=12), grads)
    for params, (adaclip, ada_norm, (adam, _), *_) in ours:
        statistics = (adaclip.max_ema, ada_norm.norm_ema, ada_norm.square_ema, adam)
        chex.assert_tree_all_finite((params, statistics))
    # The non-finite step's statistics are those of its finite elements.
    finite_w = np.where(np.isfinite(grads[10]["w"]), grads[10]["w"], 0.0)
    assert clipjax.metrics(ours[10][1])["adaclip/w/grad_max"] == np.abs(finite_w).max()
    metrics = clipjax.metrics(ours[-1][1])
    assert int(metrics["adaclip/w/nonfinite_count"]) == 2
    assert int(metrics["ada_norm/w/nonfinite_count"]) == 2
    # b never saw a non-finite value: it matches the reference throughout.
    for (params, _), expected in zip(ours, reference):
        np.testing.assert_allclose(params["b"], expected["b"], atol=ATOL)


def test_warmup_factor_is_the_cosine_of_the_reference() -> None:
    from clipjax._spam import warmup_factor

    w = 6
    c = np.arange(10)
    expected = np.where(c < w, 1 - 0.99 * (1 + np.cos(math.pi * (c + 1) / (w + 1))) / 2, 1.0)
    np.testing.assert_allclose(warmup_factor(jnp.asarray(c), w), expected, rtol=1e-6)


# --- a NaN element, against the float64 restatements ---------------------------------------
#
# Issue 37: the docstrings promised a zero update; a NaN element moved by the
# update its kept moments gave (-6.2e-4 for spam, +2.4e-3 for stable_spam).

NAN_STEPS = {12: np.nan, 30: np.inf}
SPAM_KW = dict(weight_decay=0.1, reset_interval=20, warmup_steps=5, clip_delay=3, threshold=3.0)
STABLE_KW = dict(weight_decay=0.1, reset_interval=20, theta=0.9)
RESTATE = {
    "spam": (clipjax.spam, restate_spam, SPAM_KW),
    "stable_spam": (clipjax.stable_spam, restate_stable_spam, STABLE_KW),
}


def zeroed(grads: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [
        {k: np.where(np.isfinite(g), g, 0.0).astype(g.dtype) for k, g in s.items()} for s in grads
    ]


@pytest.mark.parametrize("kind", sorted(RESTATE))
def test_a_nan_element_stays_and_the_others_step_as_without_it(kind: str) -> None:
    factory, restate, kw = RESTATE[kind]
    grads = spiky_gradients(SHAPES, 40, seed=5, element_spikes={25: 1e3}, nonfinite=NAN_STEPS)
    ours = run_ours(factory(1e-2, **kw), grads)
    # The float64 restatement, element by element, NaN steps included.
    expected = restate(PARAMS, grads, learning_rate=1e-2, **kw)
    assert_trace_close(ours, expected)
    for t in NAN_STEPS:
        before = PARAMS["w"] if t == 0 else ours[t - 1][0]["w"]
        assert ours[t][0]["w"][0, 0] == before[0, 0], f"step {t}: the NaN element moved"
    # Every other element: as in the same run with the non-finite elements 0.
    mask = np.ones(SHAPES["w"], bool)
    mask[0, 0] = False
    without = run_ours(factory(1e-2, **kw), zeroed(grads))
    for t, ((params, _), (other, _)) in enumerate(zip(ours, without)):
        if t < min(NAN_STEPS):
            continue
        np.testing.assert_allclose(params["w"][mask], other["w"][mask], rtol=1e-6, err_msg=t)
        np.testing.assert_allclose(params["b"], other["b"], rtol=1e-6, err_msg=t)


@needs_reference
@pytest.mark.parametrize("kind", sorted(RESTATE))
def test_the_restatements_are_the_references_without_nan(kind: str) -> None:
    """The float64 restatements above equal pytorch-optimizer where no element is NaN."""
    _, restate, kw = RESTATE[kind]
    grads = spiky_gradients(SHAPES, 60, seed=5, spikes={35: 50.0}, element_spikes={25: 1e3})
    lr, wd = 1e-2, kw["weight_decay"]
    if kind == "spam":
        ref_kw = dict(update_proj_gap=20, warmup_epoch=5, grad_accu_steps=3, threshold=3)
        # The reference's decay, restated exactly in optax's form (see spam's docstring).
        ours_kw = dict(kw, weight_decay=wd / (1 - lr * wd))
        lr_ours = lr * (1 - lr * wd)
    else:
        ref_kw = dict(update_proj_gap=20, theta=0.9)
        ours_kw, lr_ours = kw, lr
    reference = run_reference(
        "SPAM" if kind == "spam" else "StableSPAM", PARAMS, grads, lr=lr, weight_decay=wd, **ref_kw
    )
    restated = restate(PARAMS, grads, learning_rate=lr_ours, **ours_kw)
    for t, (got, want) in enumerate(zip(restated, reference)):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=ATOL, err_msg=f"{t} {k}")


@needs_reference
def test_spam_weight_decay_maps_exactly_onto_the_reference() -> None:
    """``lr * (1 - lr * wd)`` and ``wd / (1 - lr * wd)`` reproduce pytorch-optimizer's SPAM."""
    lr, wd, steps = 1e-2, 0.1, 120
    grads = spiky_gradients(SHAPES, steps, seed=3, spikes={50: 30.0})
    kw = dict(reset_interval=40, warmup_steps=5, clip_delay=3)
    ref_kw = dict(weight_decay=wd, update_proj_gap=40, warmup_epoch=5, grad_accu_steps=3)
    reference = run_reference("SPAM", PARAMS, grads, lr=lr, **ref_kw)

    def gap(ours: list[Any]) -> float:
        return max(float(np.abs(o[0][k] - r[k]).max()) for o, r in zip(ours, reference) for k in r)

    plain = run_ours(clipjax.spam(lr, weight_decay=wd, **kw), grads)
    mapped = run_ours(
        clipjax.spam(lr * (1 - lr * wd), weight_decay=wd / (1 - lr * wd), **kw), grads
    )
    # The plain mapping drifts by about 2.8e-4 over the 120 steps (the docstring's figure).
    assert 1e-4 < gap(plain) < 5e-4, gap(plain)
    assert gap(mapped) < ATOL, gap(mapped)

"""StableAdamW: ``clipjax.adamw(..., update_clipping=True)`` and ``clipjax.adam``'s.

Step by step against torch-optimi's and pytorch-optimizer's ``StableAdamW`` (parameters
and each tensor's RMS, recomputed from the reference's moments), including the options
where the two differ; the fold (``update_if``, no conditional, no copy); per-tensor metrics.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import compiled_train_step, full_size_conditionals, full_size_copies
from tests.skip_streams import tree_equal

# Slow: the torch references are installed by `make test-all` only. Without them the file
# still collects, so that `make test` deselects it (not reported skipped).
HAVE_REFERENCES = all(
    importlib.util.find_spec(module) is not None
    for module in ("torch", "optimi", "pytorch_optimizer")
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAVE_REFERENCES, reason="needs torch, torch-optimi and pytorch-optimizer"
    ),
]
if HAVE_REFERENCES:
    import optimi
    import pytorch_optimizer
    import torch

SHAPES = {"b": (5,), "w": (4, 3), "z": (2, 3, 2)}
LR = 1e-2
RTOL, ATOL = 2e-5, 1e-6


def stream(kind: str, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Gradient sequences: ``steady``, ``spikes``, ``burst`` (quiet, then large), ``nan``."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        if kind == "spikes" and t in (7, 19):
            g["w"] *= 300.0
        if kind == "burst":
            factor = 1e-3 if 5 <= t < 25 else (50.0 if t == 25 else 1.0)
            g = {k: v * factor for k, v in g.items()}
        if kind == "nan" and t == 9:
            g["b"][2] = np.nan
        out.append(g)
    return out


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def torch_trace(make: Any, grads: list[dict[str, np.ndarray]], coupled_wd: float = 0.0) -> Any:
    """Parameters after each step, and each tensor's RMS from the reference's moments."""
    start = initial()
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in sorted(start.items())}
    opt = make(list(tensors.values()))
    params, rms = [], []
    for g in grads:
        for k, p in tensors.items():
            p.grad = torch.tensor(g[k])
        # The gradient the reference's moments see (pytorch-optimizer adds the L2 term).
        seen = {k: g[k] + coupled_wd * p.detach().numpy() for k, p in tensors.items()}
        opt.step()
        params.append({k: p.detach().numpy().copy() for k, p in tensors.items()})
        step_rms = {}
        for k, p in tensors.items():
            v = opt.state[p]["exp_avg_sq"].numpy().astype(np.float64)
            floor = opt.param_groups[0]["eps"] ** 2
            step_rms[k] = np.sqrt(np.mean(seen[k].astype(np.float64) ** 2 / np.maximum(v, floor)))
        rms.append(step_rms)
    return params, rms


def clipjax_trace(tx: Any, grads: list[dict[str, np.ndarray]]) -> Any:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    out, rms = [], []
    for g in grads:
        params, state = step(params, state, {k: jnp.asarray(v) for k, v in g.items()})
        out.append(jax.device_get(params))
        m = clipjax.metrics(state)
        rms.append({k: float(m[f"update_clipping/{k}/rms"]) for k in SHAPES})
    return out, rms


def assert_traces_equal(ours: Any, theirs: Any) -> None:
    (params, rms), (ref_params, ref_rms) = ours, theirs
    for t, (p, q, r, s) in enumerate(zip(params, ref_params, rms, ref_rms)):
        for k in SHAPES:
            np.testing.assert_allclose(p[k], q[k], rtol=RTOL, atol=ATOL, err_msg=f"step {t} {k}")
            np.testing.assert_allclose(r[k], s[k], rtol=1e-4, err_msg=f"rms step {t} {k}")


def optimi_stable(**kw: Any) -> Any:
    return lambda ps: optimi.StableAdamW(ps, lr=LR, foreach=False, triton=False, **kw)


def pto_stable(**kw: Any) -> Any:
    return lambda ps: pytorch_optimizer.StableAdamW(ps, lr=LR, kahan_sum=False, **kw)


TRACES = [("steady", 40), ("spikes", 40), ("burst", 40), ("long", 400)]


def adamw(eps: float) -> Any:
    """The references' defaults: betas (0.9, 0.99), weight decay 1e-2."""
    return clipjax.adamw(LR, b2=0.99, eps=eps, weight_decay=1e-2, update_clipping=True)


# Each reference with its defaults: betas (0.9, 0.99), weight decay 1e-2 times the
# clipped learning rate; eps 1e-6 (optimi) and 1e-8 (pytorch-optimizer).
REFERENCES = {"optimi": (optimi_stable, 1e-6), "pytorch_optimizer": (pto_stable, 1e-8)}


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@pytest.mark.parametrize(("kind", "steps"), TRACES, ids=[k for k, _ in TRACES])
def test_trace_equals_the_reference(reference: str, kind: str, steps: int) -> None:
    make, eps = REFERENCES[reference]
    grads = stream(kind, steps)
    theirs = torch_trace(make(), grads)
    ours = clipjax_trace(adamw(eps), grads)
    assert_traces_equal(ours, theirs)
    if kind == "burst":
        # The burst after the quiet period is what the clipping is for.
        assert max(r["w"] for r in ours[1]) > 3.0


# optimi warns on every decouple_lr=True optimizer that its weight decay is not scaled by lr.
@pytest.mark.filterwarnings("ignore:You are using weight_decay:UserWarning")
def test_optimi_fully_decoupled_weight_decay_is_weight_decay_over_max_lr() -> None:
    grads = stream("burst", 40)
    theirs = torch_trace(optimi_stable(weight_decay=1e-3, decouple_lr=True, max_lr=0.05), grads)
    ours = clipjax_trace(
        clipjax.adamw(LR, b2=0.99, eps=1e-6, weight_decay=1e-3 / 0.05, update_clipping=True), grads
    )
    assert_traces_equal(ours, theirs)


def test_pytorch_optimizer_coupled_decay_is_decay_chained_before_adam() -> None:
    grads = stream("spikes", 40)
    theirs = torch_trace(pto_stable(weight_decay=0.1, weight_decouple=False), grads, 0.1)
    tx = optax.chain(
        optax.add_decayed_weights(0.1), clipjax.adam(LR, b2=0.99, eps=1e-8, update_clipping=True)
    )
    assert_traces_equal(clipjax_trace(tx, grads), theirs)


def test_adam_without_decay_equals_the_references_with_zero_decay() -> None:
    grads = stream("burst", 40)
    theirs = torch_trace(optimi_stable(weight_decay=0.0), grads)
    ours = clipjax_trace(clipjax.adam(LR, b2=0.99, eps=1e-6, update_clipping=True), grads)
    assert_traces_equal(ours, theirs)


def test_a_nan_gradient_element_stays_in_its_elements_as_in_torch_optimi() -> None:
    grads = stream("nan", 14)
    (params, _), (ref_params, _) = (
        clipjax_trace(adamw(1e-6), grads),
        torch_trace(optimi_stable(), grads),
    )
    for p, q in zip(params, ref_params):
        for k in SHAPES:
            np.testing.assert_allclose(p[k], q[k], rtol=RTOL, atol=ATOL, equal_nan=True)
    assert np.isnan(params[-1]["b"][2]) and np.isfinite(np.delete(params[-1]["b"], 2)).all()
    assert np.isfinite(params[8]["b"]).all()


def test_fix_pytorch_optimizer_a_nan_element_makes_the_whole_tensor_nan() -> None:
    """**FIX**: pytorch-optimizer clamps a NaN RMS to NaN: every element of the tensor goes NaN."""
    grads = stream("nan", 14)
    (params, _), (ref_params, _) = (
        clipjax_trace(adamw(1e-8), grads),
        torch_trace(pto_stable(), grads),
    )
    for t in range(9):  # equal up to the NaN
        for k in SHAPES:
            np.testing.assert_allclose(params[t][k], ref_params[t][k], rtol=RTOL, atol=ATOL)
    assert np.isnan(ref_params[-1]["b"]).all()
    assert np.isfinite(np.delete(params[-1]["b"], 2)).all()
    for k in ("w", "z"):  # the other tensors are unaffected in both
        np.testing.assert_allclose(params[-1][k], ref_params[-1][k], rtol=RTOL, atol=ATOL)


def test_divisor_is_max_of_one_and_rms_and_off_is_optax() -> None:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    tx = clipjax.adamw(LR, b2=0.99, update_clipping=True)
    state = tx.init(params)
    for g in stream("burst", 26):
        _, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
    m = clipjax.metrics(state)
    for k in SHAPES:
        divisor = float(m[f"update_clipping/{k}/divisor"])
        assert divisor == pytest.approx(max(1.0, float(m[f"update_clipping/{k}/rms"])))
    assert max(float(m[f"update_clipping/{k}/divisor"]) for k in SHAPES) > 1.0
    # Off, the state is optax's (loadable into optax.adamw and back).
    off = clipjax.adamw(LR).init(params)
    assert jax.tree.structure(off) == jax.tree.structure(optax.adamw(LR).init(params))


def test_update_if_skips_bit_identically_and_takes_as_update() -> None:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    for tx in (
        clipjax.adamw(LR, weight_decay=0.1, update_clipping=True),
        clipjax.adam(LR, nesterov=True, update_clipping=True),
    ):
        state = tx.init(params)
        for g in stream("spikes", 10):
            g = {k: jnp.asarray(v) for k, v in g.items()}
            bad = {**g, "w": g["w"] * jnp.inf}
            skipped, kept = tx.update_if(False, bad, state, params)
            assert tree_equal(kept, state)
            chex.assert_trees_all_equal(skipped, jax.tree.map(jnp.zeros_like, g))
            taken, new = tx.update_if(True, g, state, params)
            expected, expected_state = tx.update(g, state, params)
            chex.assert_trees_all_close(
                (taken, new), (expected, expected_state), rtol=1e-6, atol=1e-9
            )
            state = new


def test_skip_on_spike_around_it_has_no_conditional_and_no_copy() -> None:
    inner = clipjax.adamw(1e-3, weight_decay=0.1, update_clipping=True)
    compiled, _ = compiled_train_step(clipjax.skip_on_spike(inner))
    text = compiled.as_text()
    assert full_size_copies(text, {(64, 64), (64,)}) == 0
    assert full_size_conditionals(text, {(64, 64), (64,)}) == 0
    alone, _ = compiled_train_step(inner)
    assert full_size_copies(alone.as_text(), {(64, 64), (64,)}) == 0


def test_under_skip_on_spike_metrics_and_a_lax_scan() -> None:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    tx = clipjax.skip_on_spike(
        clipjax.adamw(LR, update_clipping=True), window_size=8, min_history=4, sigma=3.0
    )
    grads = jax.tree.map(lambda *x: jnp.stack(x), *stream("spikes", 30))

    def body(carry: Any, g: Any) -> Any:
        p, s = carry
        updates, s = tx.update(g, s, p)
        m = clipjax.metrics(s)
        return (optax.apply_updates(p, updates), s), (
            m["skip_on_spike/global/skipped"],
            m["update_clipping/w/divisor"],
        )

    (p, _), (skipped, divisor) = jax.lax.scan(body, (params, tx.init(params)), grads)
    assert bool(skipped[19]) and not bool(skipped[3])
    assert divisor.shape == (30,) and bool(jnp.all(divisor >= 1.0))
    chex.assert_tree_all_finite(p)


def test_state_round_trips_through_flax_serialization() -> None:
    serialization = pytest.importorskip("flax.serialization")
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    tx = clipjax.adamw(LR, weight_decay=0.1, update_clipping=True)
    state = tx.init(params)
    for g in stream("burst", 27):
        _, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
    assert tree_equal(restored, state)
    assert clipjax.metrics(restored).keys() == clipjax.metrics(state).keys()

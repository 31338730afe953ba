"""A clipper after the optimizer clips the update: ``chain(adamw, clipper)`` equals the clipper
run on adamw's updates by itself (outputs and metrics), for every clipper of
``tests.registry.CLIPPER_IDS``; ``name="update_..."`` names its metrics; it works under
``skip_on_spike`` on the fold route (no conditional, no full-size copy) as around optax's."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import compiled_train_step, full_size_conditionals, full_size_copies
from tests.model import batches, loss_fn, mlp_params
from tests.registry import CASES, CLIPPER_IDS

LR = 1e-2
STEPS = 12


def gradients() -> list[Any]:
    params = mlp_params()
    return [jax.grad(loss_fn)(params, batch) for batch in batches(STEPS)]


@pytest.mark.parametrize("case", CLIPPER_IDS)
def test_after_the_optimizer_it_clips_the_update(case: str) -> None:
    make = CASES[case].make
    params = mlp_params()
    grads = gradients()
    chained = optax.chain(optax.adamw(LR), make(name=f"update_{case}"))
    adamw, alone = optax.adamw(LR), make()
    state = chained.init(params)
    adamw_state, alone_state = adamw.init(params), alone.init(params)
    step = jax.jit(chained.update)
    for g in grads:
        out, state = step(g, state, params)
        adam_updates, adamw_state = adamw.update(g, adamw_state, params)
        expected, alone_state = alone.update(adam_updates, alone_state, params)
        chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-9)
        ours, theirs = clipjax.metrics(state), clipjax.metrics(alone_state)
        renamed = lambda key: key.replace(f"update_{case}/", f"{CASES[case].algo}/", 1)
        assert {renamed(k) for k in ours} == set(theirs)
        for key, value in ours.items():
            want = np.asarray(theirs[renamed(key)])
            np.testing.assert_allclose(np.asarray(value), want, rtol=1e-4, atol=1e-7, err_msg=key)
    norm = [k for k in ours if k.endswith("/grad_norm") and "/leaf/" not in k]
    if CASES[case].scope == "global" and norm:  # it judged the update's norm, not the gradient's
        np.testing.assert_allclose(float(ours[norm[0]]), optax.tree.norm(adam_updates), rtol=1e-5)


def test_levanter_style_update_norm_clip_stops_an_update_spike() -> None:
    """A z-score clip of the update norm after AdamW (Levanter's ``clip_update_norm``): adam
    turns a 10,000x gradient spike into a jump of the update norm of about 1.5x, far outside
    their narrow spread, and the update clip cuts it back to its threshold."""
    params = mlp_params()
    clip = clipjax.zclip(0.9, 2.5, max_grad_norm=None, warmup_steps=5, name="update_zclip")
    tx = optax.chain(optax.adamw(LR), clip)
    state = tx.init(params)
    norms, scales = [], []
    rng = np.random.default_rng(0)
    for t in range(45):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
        if t == 40:
            g = jax.tree.map(lambda x: 1e4 * x, g)
        updates, state = tx.update(g, state, params)
        m = clipjax.metrics(state)
        norms.append(float(m["update_zclip/global/grad_norm"]))
        scales.append(float(m["update_zclip/global/scale"]))
        if t == 40:
            applied = float(optax.tree.norm(updates))
    assert norms[40] > 1.3 * max(norms[30:40])
    assert scales[40] < 1.0 and sum(s < 1.0 for s in scales[30:40]) <= 1
    np.testing.assert_allclose(applied, scales[40] * norms[40], rtol=1e-5)
    assert applied < 1.5 * max(norms[30:40]) < norms[40]


@pytest.mark.parametrize(
    "clipper",
    [
        lambda: clipjax.zclip(warmup_steps=3, name="update_zclip"),
        lambda: clipjax.agc(clipping=0.05, scope="per_layer", name="update_agc"),
    ],
    ids=["zclip", "agc_with_params"],
)
def test_under_skip_on_spike_on_the_fold_route(clipper: Any) -> None:
    """``clipjax.chain(clipjax.adamw, clipper)``: the same steps as optax's chain, no cond."""
    params = mlp_params()
    grads = gradients()
    grads[7] = jax.tree.map(lambda x: 1e3 * x, grads[7])
    kw = {"window_size": 6, "min_history": 4, "sigma": 3.0}
    ours = clipjax.skip_on_spike(clipjax.chain(clipjax.adamw(LR), clipper()), **kw)
    theirs = clipjax.skip_on_spike(optax.chain(optax.adamw(LR), clipper()), **kw)
    s, e = ours.init(params), theirs.init(params)
    for g in grads:
        u, s = jax.jit(ours.update)(g, s, params)
        eu, e = jax.jit(theirs.update)(g, e, params)
        chex.assert_trees_all_close(u, eu, rtol=1e-5, atol=1e-9)
        m, em = clipjax.metrics(s), clipjax.metrics(e)
        assert set(m) == set(em)
        for key in m:
            np.testing.assert_allclose(m[key], em[key], rtol=1e-4, atol=1e-7, err_msg=key)
    assert bool(clipjax.metrics(s)["skip_on_spike/global/skipped_count"] >= 1)
    assert any(k.startswith("update_") for k in clipjax.metrics(s))
    compiled, _ = compiled_train_step(
        clipjax.skip_on_spike(clipjax.chain(clipjax.adamw(1e-3), clipper()))
    )
    text = compiled.as_text()
    assert full_size_copies(text, {(64, 64), (64,)}) == 0
    assert full_size_conditionals(text, {(64, 64), (64,)}) == 0

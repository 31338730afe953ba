"""``optax.inject_hyperparams`` without surprises, for every public transform factory.

inject_hyperparams turns every number given, and every numeric default, into an array. Every
argument a user would schedule works that way with no ``static_args``; the few numbers that
size a buffer or pick the arithmetic are on the docstring's "Static arguments:" line, default
to None, and must be named in ``static_args`` when given. Each case injects all of its
numbers at values other than the defaults and runs 3 jitted updates (the last a spike)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import clipjax
from tests.model import grads_at

PARAMS = {
    "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3),
    "b": jnp.full((3,), 0.5, jnp.float32),
}
STEPS = 3
SPIKE = STEPS - 1  # the step whose gradients spike


def hist_clip_zstat(alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 20) -> Any:
    criterion = clipjax.zstat_criterion(alpha, z_thresh)
    return clipjax.hist_clip(criterion, warmup_steps=warmup_steps)


def skip_on_spike_adamw(
    sigma: float = 6.0, min_history: int | None = None, max_consecutive_skips: int | None = None
) -> Any:
    return clipjax.skip_on_spike(
        clipjax.adamw(1e-2),
        sigma=sigma,
        min_history=min_history,
        max_consecutive_skips=max_consecutive_skips,
    )


def skip_and_clip_adamw(
    drop_norm: float | None = None, max_norm: float | None = None, eps: float = 1e-8
) -> Any:
    return clipjax.skip_and_clip_by_global_norm(
        clipjax.adamw(1e-2), drop_norm=drop_norm, max_norm=max_norm, eps=eps
    )


def skip_and_clip_rule(
    max_norm: float | None = None, grad_norm_ema_decay: float | None = None, eps: float = 1e-8
) -> Any:
    """With a drop rule (a callable: never injected)."""
    return clipjax.skip_and_clip_by_global_norm(
        clipjax.adamw(1e-2),
        drop_norm=clipjax.drop_norm_by_grad_norm_ema((2,)),
        max_norm=max_norm,
        grad_norm_ema_decay=grad_norm_ema_decay,
        eps=eps,
    )


# case -> (factory, keyword arguments: every number in them is injected)
# Adam's numbers, other than the defaults, for the optimizers built on it.
LR = dict(learning_rate=1e-2)
ADAM = dict(**LR, b1=0.8, b2=0.99, eps=1e-7)
CEIL, ONE = dict(max_grad_norm=40.0), dict(warmup_steps=1, min_history=1)
PCT = dict(mode="percentile", percentile=80.0)
CASES: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "autoclip_all": (clipjax.autoclip, dict(warmup_steps=1, min_history=2, eps=1e-6, **CEIL)),
    "autoclip_window_clipped": (
        clipjax.autoclip,
        dict(feedback="clipped", **ONE, eps=1e-6, **CEIL),
    ),
    "autoclip_percentile": (clipjax.autoclip, dict(**PCT, **ONE)),
    "autoclip_ema": (clipjax.autoclip, dict(**PCT, history="ema", ema_decay=0.9, warmup_steps=1)),
    "autoclip_geometric": (clipjax.autoclip, dict(**PCT, history="geometric", quantile_lr=0.3)),
    "zscore_clip": (
        clipjax.zscore_clip,
        dict(zmax=1.5, ema_decay=0.9, **ONE, eps=1e-6, feedback="clipped", **CEIL),
    ),
    "zclip": (
        clipjax.zclip,
        dict(alpha=0.8, z_thresh=1.5, **CEIL, eps=1e-5, warmup_steps=2, clip_factor=0.9),
    ),
    "zclip_relative": (
        clipjax.zclip,
        dict(feedback="clipped", alpha=0.8, relative_ceiling=2.0, warmup_steps=3, eps=1e-5),
    ),
    "zclip_percentile": (
        clipjax.zclip,
        dict(mode="percentile", alpha=0.8, z_thresh=1.0, warmup_steps=1, **CEIL),
    ),
    "hist_clip": (clipjax.hist_clip, dict(warmup_steps=2, feedback="clipped", **CEIL)),
    "hist_clip_zstat": (hist_clip_zstat, dict(alpha=0.8, z_thresh=1.0, warmup_steps=1)),
    "adagc": (
        clipjax.adagc,
        dict(relative_threshold=1.2, beta=0.9, warmup_steps=1, absolute_threshold=5.0, eps=1e-5),
    ),
    "agc": (clipjax.agc, dict(clipping=0.05, eps=1e-2)),
    "agc_per_layer": (clipjax.agc, dict(clipping=0.05, eps=1e-2, scope="per_layer")),
    "clip_by_global_norm": (clipjax.clip_by_global_norm, dict(max_norm=2.0, eps=1e-6)),
    "clip_by_value": (clipjax.clip_by_value, dict(max_abs=0.5)),
    "clip_by_percentile": (clipjax.clip_by_percentile, dict(percentile=60.0)),
    "normalize_per_param": (clipjax.normalize_per_param, dict(eps=1e-3)),
    "zscore_normalize": (clipjax.zscore_normalize, dict(eps=1e-3)),
    "adaclip": (clipjax.adaclip, dict(theta=0.9)),
    "ada_norm": (clipjax.ada_norm, dict(gamma1=0.6, gamma2=0.8, eps=1e-6)),
    "spam": (
        clipjax.spam,
        dict(ADAM, weight_decay=0.1, threshold=3.0, reset_interval=2, warmup_steps=1, clip_delay=1),
    ),
    "stable_spam": (
        clipjax.stable_spam,
        dict(ADAM, gamma1=0.6, gamma2=0.8, theta=0.9, weight_decay=0.1, reset_interval=2),
    ),
    "skip_on_spike": (skip_on_spike_adamw, dict(sigma=1.0, min_history=2, max_consecutive_skips=3)),
    "adam": (clipjax.adam, dict(ADAM, eps_root=1e-9)),
    "adamw": (clipjax.adamw, dict(ADAM, eps_root=1e-9, weight_decay=0.1)),
    "adam_clip": (
        clipjax.adam,
        dict(**LR, clip_grad_adapt=1.0, clip_grad_min=1e-6, clip_grad_warm_up=1),
    ),
    "adamw_clip": (
        clipjax.adamw,
        dict(**LR, weight_decay=0.1, clip_grad_adapt=2.0, clip_grad_min=1e-3, clip_grad_warm_up=2),
    ),
    "clip_norm_growth": (
        clipjax.clip_norm_growth,
        dict(add=0.3, mul=1.2, min_value=1e-3, max_decay=3.0),
    ),
    "clip_norm_by_ema": (
        clipjax.clip_norm_by_ema,
        dict(beta=0.9, max_ema_growth=1.2, init=0.01, min_norm=1e-4),
    ),
    "clip_by_historical_norm": (
        clipjax.clip_by_historical_norm,
        dict(sigma_factor=1.5, min_history=2),
    ),
    "skip_and_clip": (skip_and_clip_adamw, dict(drop_norm=3.0, max_norm=0.5, eps=1e-6)),
    "stability_monitor": (clipjax.stability_monitor, dict(threshold_std=1.5)),
    "spectra": (clipjax.spectra, dict(c=0.7)),
    "spectral_clip": (clipjax.spectral_clip, dict(threshold=0.3)),
    "spectral_clip_ema": (clipjax.spectral_clip, dict(rule="ema", ema_coef=0.8, factor=1.1)),
    "skip_and_clip_rule": (
        skip_and_clip_rule,
        dict(max_norm=0.5, grad_norm_ema_decay=0.9, eps=1e-6),
    ),
}

# The public factories the coverage test holds to account, and the case factories standing
# for them.
PUBLIC = """autoclip zscore_clip zclip hist_clip adagc agc clip_by_global_norm clip_by_value
    clip_by_percentile normalize_per_param zscore_normalize adaclip ada_norm spam stable_spam
    skip_on_spike adam adamw clip_norm_growth clip_norm_by_ema clip_by_historical_norm
    skip_and_clip_by_global_norm stability_monitor spectra spectral_clip"""
FACTORIES = {name: getattr(clipjax, name) for name in PUBLIC.split()}
STANDS_FOR = {
    skip_on_spike_adamw: clipjax.skip_on_spike,
    hist_clip_zstat: clipjax.hist_clip,
    skip_and_clip_adamw: clipjax.skip_and_clip_by_global_norm,
    skip_and_clip_rule: clipjax.skip_and_clip_by_global_norm,
}


def numeric(parameter: inspect.Parameter) -> bool:
    """Whether a user may pass a number for this parameter."""
    if isinstance(parameter.default, (int, float)):
        return not isinstance(parameter.default, bool)
    return bool(re.search(r"\b(float|int|ScalarOrSchedule)\b", str(parameter.annotation)))


def static_arguments(factory: Any) -> set[str]:
    """The ``name`` literals of the docstring's "Static arguments:" line (up to its ';')."""
    doc = inspect.getdoc(factory) or ""
    match = re.search(r"^Static arguments: (.*?);", doc, re.M | re.S)
    assert match, f"{factory.__name__}'s docstring has no 'Static arguments: ...;' line"
    return set(re.findall(r"``(\w+)``", match.group(1)))


def test_every_numeric_argument_is_injected_or_documented_static() -> None:
    injected: dict[str, set[str]] = {name: set() for name in FACTORIES}
    for factory, kwargs in CASES.values():
        factory = STANDS_FOR.get(factory, factory)
        injected[factory.__name__] |= set(kwargs)
    problems = []
    for name, factory in FACTORIES.items():
        static = static_arguments(factory)
        params = inspect.signature(factory).parameters
        assert static <= set(params), (name, static)
        for p in params.values():
            if numeric(p) and p.name not in static and p.name not in injected[name]:
                problems.append(f"{name}: {p.name} is neither injected by a case nor static")
            if p.name in static and isinstance(p.default, (int, float)):
                problems.append(f"{name}: static {p.name} defaults to a number, not None")
    assert not problems, "\n".join(problems)


# Python floats enter the plain factory's arithmetic before rounding to float32;
# injected ones are float32 arrays: last-bit noise.
TOLERANCE = dict(rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_injected_equals_the_factory_called_with_the_same_values(case: str) -> None:
    factory, kwargs = CASES[case]
    injected = optax.inject_hyperparams(factory)(**kwargs)  # no static_args
    plain = factory(**kwargs)
    state = injected.init(PARAMS)
    assert set(state.hyperparams) >= {k for k, v in kwargs.items() if not isinstance(v, str)}
    plain_state = plain.init(PARAMS)
    update, plain_update = jax.jit(injected.update), jax.jit(plain.update)
    for t in range(STEPS):
        grads = grads_at(PARAMS, t, spike=SPIKE)
        out, state = update(grads, state, PARAMS)
        expected, plain_state = plain_update(grads, plain_state, PARAMS)
        chex.assert_trees_all_close(out, expected, **TOLERANCE)
    chex.assert_trees_all_close(state.inner_state, plain_state, **TOLERANCE)
    if factory not in (clipjax.adam, clipjax.adamw):
        ours, theirs = clipjax.metrics(state), clipjax.metrics(plain_state)
        assert ours.keys() == theirs.keys() and ours
        chex.assert_trees_all_close(ours, theirs, **TOLERANCE)


def test_the_issue_examples_need_no_static_args() -> None:
    """Issue 37: each failed on an argument the user never passed."""
    for tx in (
        optax.inject_hyperparams(clipjax.zclip)(z_thresh=2.0),
        optax.inject_hyperparams(clipjax.hist_clip)(),
        optax.inject_hyperparams(clipjax.clip_by_global_norm)(max_norm=1.0),
    ):
        jax.jit(tx.update)(grads_at(PARAMS, 0, spike=SPIKE), tx.init(PARAMS), PARAMS)


def test_a_static_argument_given_says_to_name_it() -> None:
    inject = optax.inject_hyperparams(clipjax.clip_by_global_norm)
    with pytest.raises(ValueError, match=r"norm_type fixes .*static_args=\('norm_type',\)"):
        inject(max_norm=1.0, norm_type=float("inf")).init(PARAMS)
    tx = optax.inject_hyperparams(clipjax.clip_by_global_norm, static_args=("norm_type",))(
        max_norm=1.0, norm_type=float("inf")
    )
    out, _ = jax.jit(tx.update)(grads_at(PARAMS, 2, spike=SPIKE), tx.init(PARAMS), PARAMS)
    assert float(clipjax.global_norm(out, float("inf"))) == pytest.approx(1.0, rel=1e-5)

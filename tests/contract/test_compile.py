"""Compile cost grows with the leaves no faster than optax's (``benchmarks/compile.py`` times
it): distinct fusion bodies do not grow with the leaves, the HLO and jaxpr each leaf adds stay
near optax's; reading the metrics of a concrete state compiles nothing."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%[\w.\-]+\s*=", re.M)
_FEW, _MANY = 8, 24


def _step(make: Callable[[], Any], leaves: int, value: bool = False) -> tuple[Any, tuple]:
    """A training step through ``make()`` on ``leaves`` [8, 8] leaves, and its abstract args."""
    leaf = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    shapes = {"params": {f"w{i:03d}": leaf for i in range(leaves)}}
    tx = make()

    def step(params: Any, state: Any, grads: Any, loss: Any) -> Any:
        updates, state = tx.update(grads, state, params, **({"value": loss} if value else {}))
        return optax.apply_updates(params, updates), state

    loss = jax.ShapeDtypeStruct((), jnp.float32)
    return step, (shapes, jax.eval_shape(tx.init, shapes), shapes, loss)


def _step_hlo(make: Callable[[], Any], leaves: int, value: bool = False) -> str:
    step, args = _step(make, leaves, value)
    return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()


def _growth(count: Callable[[int], int]) -> float:
    """How much ``count(leaves)`` grows with each extra leaf."""
    return (count(_MANY) - count(_FEW)) / (_MANY - _FEW)


def _distinct_fusions(hlo: str) -> int:
    bodies = set()
    for block in re.split(r"\n(?=\S)", hlo):
        head, _, body = block.partition("\n")
        if "fused_computation" in head:
            body = re.sub(r", metadata=\{[^}]*\}", "", body)
            bodies.add(re.sub(r"%[\w.\-]+", "%x", body))
    return len(bodies)


def _instructions_per_leaf(make: Callable[[], Any], value: bool = False) -> float:
    return _growth(lambda leaves: len(_INSTRUCTION.findall(_step_hlo(make, leaves, value))))


def _adamw(clipper: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: optax.chain(clipper(), optax.adamw(1e-3))


def _skip_chain() -> Any:
    return clipjax.skip_on_spike(clipjax.chain(clipjax.zclip(), clipjax.adamw(1e-3)))


DISTINCT = {
    "agc": (_adamw(lambda: clipjax.agc(0.01)), False),
    "zclip[per_param]": (_adamw(lambda: clipjax.zclip(scope="per_param")), False),
    "normalize_per_param": (_adamw(clipjax.normalize_per_param), False),
    "clip_by_percentile": (_adamw(lambda: clipjax.clip_by_percentile(99.0)), False),
    "hist_clip[per_param]": (_adamw(lambda: clipjax.hist_clip(scope="per_param")), False),
    "skip_on_spike(chain(zclip, adamw))": (_skip_chain, True),
    "adaclip": (_adamw(clipjax.adaclip), False),
    "ada_norm": (_adamw(clipjax.ada_norm), False),
    "stable_spam": (lambda: clipjax.stable_spam(1e-3), False),
    "spam": (lambda: clipjax.spam(1e-3), False),
    "adamw(update_clipping=True)": (lambda: clipjax.adamw(1e-3, update_clipping=True), False),
}


@pytest.mark.parametrize("name", DISTINCT)
def test_distinct_fusions_do_not_grow_with_the_leaves(name: str) -> None:
    make, value = DISTINCT[name]
    few = _distinct_fusions(_step_hlo(make, _FEW, value))
    many = _distinct_fusions(_step_hlo(make, _MANY, value))
    # A fusion that stacks one value per leaf differs with the leaf count (older XLA
    # keeps the stack of per-leaf metrics in a fusion of its own): a slack of two, where
    # fusions made per leaf would add one or more for each of the 16 extra leaves.
    assert many <= few + 2, f"{name}: {few} distinct fusions at {_FEW} leaves, {many} at {_MANY}"


# Bound on the ratio of HLO instructions a leaf; agc's metrics once added a small
# reduction to every leaf (1.3x optax's instructions, 2x its compile time). Since the
# overflow-safe norms (SPEC 9.8) agc's unit norms carry a recompute of every leaf's
# unit norms in the branch an overflowing step takes: 225.5 instructions a leaf
# against optax's 106.0 (jax 0.10.2), bounded here so that it cannot grow further;
# folding that branch into fewer instructions is open work.
PER_LEAF_BOUND = {"agc vs optax.adaptive_grad_clip": 2.2}
PER_LEAF = {
    "agc vs optax.adaptive_grad_clip": (
        (_adamw(lambda: clipjax.agc(0.01)), False),
        (_adamw(lambda: optax.adaptive_grad_clip(0.01)), False),
    ),
    "zclip vs optax.clip_by_global_norm": (
        (_adamw(clipjax.zclip), False),
        (_adamw(lambda: optax.clip_by_global_norm(1.0)), False),
    ),
    "skip_on_spike(clipjax.adamw) vs optax.apply_if_finite(adamw)": (
        (lambda: clipjax.skip_on_spike(clipjax.adamw(1e-3)), True),
        (lambda: optax.apply_if_finite(optax.adamw(1e-3), 10), False),
    ),
    "skip_on_spike(chain(zclip, adamw)) vs chain(zclip, optax.adamw)": (
        (_skip_chain, True),
        (_adamw(clipjax.zclip), False),
    ),
}


@pytest.mark.parametrize("name", PER_LEAF)
def test_each_leaf_adds_about_as_much_hlo_as_optax(name: str) -> None:
    (mine, mine_value), (ref, ref_value) = PER_LEAF[name]
    ours, theirs = _instructions_per_leaf(mine, mine_value), _instructions_per_leaf(ref, ref_value)
    bound = PER_LEAF_BOUND.get(name, 1.4)
    assert ours <= bound * theirs, f"{name}: {ours:.1f} HLO instructions a leaf vs {theirs:.1f}"


_SELECT = re.compile(r"=\s*\S+\s+select\(")


@pytest.mark.parametrize(
    "make",
    [_skip_chain, lambda: clipjax.skip_on_spike(clipjax.adamw(1e-3))],
    ids=["skip_on_spike(chain(zclip, adamw))", "skip_on_spike(adamw)"],
)
def test_a_folded_skip_zeroes_the_updates_once(make: Callable[[], Any]) -> None:
    # Each moment is selected once (and its gradient zeroed once); the update is
    # zeroed once after the chain's last member, not after each of adamw's three.
    per_leaf = _growth(lambda leaves: len(_SELECT.findall(_step_hlo(make, leaves, True))))
    assert per_leaf <= 5, f"{per_leaf:.1f} selects a leaf"


def test_metrics_of_a_concrete_state_compile_nothing(caplog: pytest.LogCaptureFixture) -> None:
    params = {f"w{i}": jnp.full((3,), float(i)) for i in range(40)}
    tx = optax.chain(clipjax.zclip(scope="per_param"), optax.adamw(1e-3))
    state = jax.jit(tx.update)(params, tx.init(params), params)[1]
    jax.block_until_ready(state)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        values = clipjax.metrics(state)
    compiled = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert not compiled, compiled[:3]
    norms = np.asarray(state[0].metrics["grad_norm"])
    for group, norm in zip(state[0].info.groups, norms, strict=True):
        assert values[f"zclip/{group}/grad_norm"] == norm
        assert values[f"zclip/{group}/grad_norm"].shape == ()


def _jaxpr_eqns_per_leaf(make: Callable[[], Any]) -> float:
    def eqns(leaves: int) -> int:
        step, args = _step(make, leaves)
        return len(jax.make_jaxpr(step)(*args).jaxpr.eqns)

    return _growth(eqns)


# The transforms whose per-leaf arithmetic runs through _xla.per_leaf.
PER_LEAF_TRACED = {
    "spam": lambda: clipjax.spam(1e-3),
    "stable_spam": lambda: clipjax.stable_spam(1e-3),
    "zscore_normalize": _adamw(clipjax.zscore_normalize),
    "clip_by_value": _adamw(lambda: clipjax.clip_by_value(1.0)),
    "clip_by_percentile": _adamw(lambda: clipjax.clip_by_percentile(90.0)),
    "adaclip": _adamw(clipjax.adaclip),
    "agc": _adamw(lambda: clipjax.agc(0.01)),
}


@pytest.mark.parametrize("name", PER_LEAF_TRACED)
def test_each_leaf_adds_no_more_to_the_trace_than_optax(name: str) -> None:
    # Each equation of the step's jaxpr is a call traced and lowered once per
    # leaf. Traced leaf by leaf, SPAM's and Stable-SPAM's steps added 3x optax's
    # (3.7 s of Python at 500 leaves), zscore_normalize's and clip_by_percentile's
    # 1.7-1.9x; through per_leaf the most is 0.9x on jax 0.10 and 1.56x on jax
    # 0.4.36, which inlines jnp's index arithmetic (the leaves' group offsets).
    ours = _jaxpr_eqns_per_leaf(PER_LEAF_TRACED[name])
    theirs = _jaxpr_eqns_per_leaf(_adamw(lambda: optax.clip_by_global_norm(1.0)))
    assert ours <= 1.6 * theirs, f"{name}: {ours:.1f} jaxpr equations a leaf vs {theirs:.1f}"


@pytest.mark.parametrize("name", PER_LEAF_TRACED)
def test_tracing_once_per_leaf_signature_compiles_the_same_step(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced_once = _step_hlo(PER_LEAF_TRACED[name], _FEW)
    monkeypatch.setattr(
        clipjax._xla, "per_leaf", lambda fn, *shared: lambda *leaf: fn(*leaf, *shared)
    )
    traced_per_leaf = _step_hlo(PER_LEAF_TRACED[name], _FEW)
    assert len(_INSTRUCTION.findall(traced_once)) == len(_INSTRUCTION.findall(traced_per_leaf))
    assert _distinct_fusions(traced_once) == _distinct_fusions(traced_per_leaf)

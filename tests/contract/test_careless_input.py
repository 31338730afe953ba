"""Careless input a newcomer writes: ``name="a/b"`` and numbers given as strings are refused
with a message that names them; NumPy float64 gradients are cast quietly, as optax casts them."""

from __future__ import annotations

import inspect
import re
import warnings
from functools import partial

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

PLAIN = """autoclip zscore_clip hist_clip adagc agc normalize_per_param adaclip ada_norm
    clip_norm_growth clip_by_historical_norm"""
FACTORIES = {n: getattr(clipjax, n) for n in PLAIN.split()} | {
    "zclip": lambda: clipjax.zclip(feedback="clipped"),
    "zclip_cap": clipjax.zclip,
    "clip_by_global_norm": lambda: clipjax.clip_by_global_norm(1.0),
    "clip_by_value": lambda: clipjax.clip_by_value(1.0),
    "clip_by_percentile": lambda: clipjax.clip_by_percentile(90),
    "spam": lambda: clipjax.spam(1e-3),
    "skip_on_spike": lambda: clipjax.skip_on_spike(clipjax.adam(1e-3)),
    "chain": lambda: clipjax.chain(clipjax.zclip(feedback="clipped"), clipjax.adamw(1e-3)),
}


@pytest.mark.parametrize("case", sorted(FACTORIES))
def test_numpy_float64_gradients_are_cast_quietly(case: str) -> None:
    tx = FACTORIES[case]()
    params = {"w": np.zeros((4, 3)), "b": np.zeros(3)}
    grads = {"w": np.full((4, 3), 2.0), "b": np.ones(3)}
    extra = {"value": 1.0} if case == "skip_on_spike" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = tx.init(params)
        updates, state = tx.update(grads, state, params, **extra)
    assert all(u.dtype == jnp.float32 for u in updates.values())
    assert clipjax.metrics(state)


NAMED = {"zclip": clipjax.zclip, "clip_by_global_norm": partial(clipjax.clip_by_global_norm, 1.0)}
NAMED |= {
    "skip_on_spike": partial(clipjax.skip_on_spike, optax.identity()),
    "autoclip": clipjax.autoclip,
}


@pytest.mark.parametrize("make", NAMED.values(), ids=NAMED)
def test_a_name_with_a_slash_is_refused(make) -> None:
    with pytest.raises(ValueError, match=r"name must not contain '/'.*'a/b'"):
        make(name="a/b")
    make(name="a_b")  # accepted


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: clipjax.zclip(alpha="0.9"), "alpha"),
        (lambda: clipjax.zclip(z_thresh="2.5"), "z_thresh"),
        (lambda: clipjax.autoclip(mode="percentile", percentile="95"), "percentile"),
        (lambda: clipjax.clip_by_global_norm("1.0"), "max_norm"),
    ],
)
def test_a_number_given_as_a_string_is_named_a_type_mistake(make, arg: str) -> None:
    with pytest.raises(ValueError, match=rf"{arg} must be a (nonzero )?number .*\(a str\)"):
        make()


def test_a_type_mistake_reads_as_one_sentence() -> None:
    """0.4: 'max_norm must be a number a nonzero number'. Every numeric argument of
    every public factory, given as a string: the message says what it must be once."""
    from tests.contract.test_inject import FACTORIES, numeric

    with pytest.raises(ValueError) as error:
        clipjax.clip_by_global_norm("1")
    assert str(error.value).startswith("max_norm must be a nonzero number (0 would zero")
    required = dict(learning_rate=1e-3, inner=optax.identity(), max_norm=1.0, max_abs=1.0)
    required.update(percentile=90.0, c=1.0)
    messages = []
    empty = inspect.Parameter.empty
    for factory in FACTORIES.values():
        parameters = inspect.signature(factory).parameters
        given = {
            k: v for k, v in required.items() if k in parameters and parameters[k].default is empty
        }
        for p in parameters.values():
            if numeric(p):
                try:
                    factory(**{**given, p.name: "1"})
                except ValueError as e:
                    messages.append(str(e))
    assert len(messages) > 40
    doubled = [m for m in messages if re.search(r"\ba number an? ", m)]
    assert not doubled, doubled


def test_max_grad_norm_auto_is_accepted_by_every_clipper_with_a_ceiling() -> None:
    for make in (clipjax.zclip, clipjax.autoclip, clipjax.zscore_clip, clipjax.hist_clip):
        make(max_grad_norm="auto")
        with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
            make(max_grad_norm="high")

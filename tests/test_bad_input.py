"""Issue 18: careless input gets a clear error naming the argument or the leaf.

* a zero clipping bound is refused (a negative one means its absolute value);
* a ``scope`` callable that does not take ``(path, leaf)`` is refused at construction;
* ``clipjax.metrics`` refuses a transform and warns on a state without clipjax parts;
* integer leaves are refused by the element-wise clippers and normalisers, naming the leaf;
* a state restored from another model's checkpoint says which transform does not fit;
* ``optax.tree_utils.tree_map_params`` keeps a clipjax state's names and metrics.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

PARAMS = {
    "params": {
        "Dense_0": {"kernel": jnp.arange(12.0).reshape(3, 4) / 10, "bias": jnp.full((4,), 0.5)},
        "Dense_1": {"kernel": jnp.arange(8.0).reshape(4, 2) / 5 - 0.7, "bias": jnp.ones((2,))},
    }
}


def grads(scale: float = 3.0) -> Any:
    return jax.tree.map(lambda p: scale * (p + 0.1), PARAMS)


# --- a zero bound --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "argument"),
    [(clipjax.clip_by_global_norm, "max_norm"), (clipjax.clip_by_value, "max_abs")],
)
@pytest.mark.parametrize("zero", [0.0, 0, -0.0, np.float32(0.0), jnp.zeros(())])
def test_zero_bound_is_refused(make: Callable[..., Any], argument: str, zero: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{argument} must be a nonzero number"):
        make(zero)


def test_negative_bound_means_its_absolute_value() -> None:
    g = grads()
    out, _ = clipjax.clip_by_value(-0.5).update(g, clipjax.clip_by_value(-0.5).init(g))
    ref, _ = optax.clip(0.5).update(g, optax.clip(0.5).init(g))
    jax.tree.map(np.testing.assert_array_equal, out, ref)
    tx = clipjax.clip_by_global_norm(-1.0, eps=0.0)
    out, _ = tx.update(g, tx.init(g))
    ref, _ = optax.clip_by_global_norm(1.0).update(g, optax.clip_by_global_norm(1.0).init(g))
    jax.tree.map(lambda o, r: np.testing.assert_allclose(o, r, rtol=1e-6), out, ref)


def test_injected_bound_is_checked_only_when_concrete() -> None:
    # A scheduled bound arrives as a tracer: construction cannot see its value.
    tx = optax.inject_hyperparams(clipjax.clip_by_value)(max_abs=lambda count: 1.0 / (count + 1))
    out, _ = tx.update(grads(), tx.init(PARAMS))
    assert float(jnp.max(jnp.abs(out["params"]["Dense_0"]["kernel"]))) == 1.0


# --- a scope callable with the wrong signature ------------------------------------------

SCOPED: dict[str, Callable[[Any], Any]] = {
    "autoclip": lambda scope: clipjax.autoclip(scope=scope),
    "zclip": lambda scope: clipjax.zclip(scope=scope),
    "zscore_clip": lambda scope: clipjax.zscore_clip(scope=scope),
    "hist_clip": lambda scope: clipjax.hist_clip(scope=scope),
    "agc": lambda scope: clipjax.agc(scope=scope),
    "adagc": lambda scope: clipjax.adagc(scope=scope),
    "clip_by_value": lambda scope: clipjax.clip_by_value(1.0, scope=scope),
    "clip_by_percentile": lambda scope: clipjax.clip_by_percentile(90.0, scope=scope),
}


@pytest.mark.parametrize("case", sorted(SCOPED))
@pytest.mark.parametrize(
    "scope",
    [lambda path: "x", lambda: "x", lambda path, leaf, extra: "x"],
    ids=["one_argument", "no_argument", "three_arguments"],
)
def test_scope_with_wrong_arity_is_refused_at_construction(
    case: str, scope: Callable[..., str]
) -> None:
    with pytest.raises(TypeError, match=r"scope must be .*\(path, leaf\)") as info:
        SCOPED[case](scope)
    assert "<lambda>" in str(info.value)


@pytest.mark.parametrize("case", sorted(SCOPED))
def test_scope_callables_of_two_arguments_are_accepted(case: str) -> None:
    def by_layer(path: Any, leaf: Any, suffix: str = "") -> str:
        return clipjax.path_name(path[:-1]) + suffix

    for scope in (by_layer, lambda *args: clipjax.path_name(args[0][:-1])):
        tx = SCOPED[case](scope)
        state = tx.init(PARAMS)
        tx.update(grads(), state, PARAMS)
        assert state.info.groups == ("params/Dense_0", "params/Dense_1")


# --- clipjax.metrics on what is not a clipjax state ---------------------------------------


@pytest.mark.parametrize(
    "thing",
    [
        clipjax.autoclip(),
        optax.chain(clipjax.zclip(), optax.adam(1e-3)),
        optax.adam(1e-3),
        clipjax.autoclip,
    ],
    ids=["transform", "chain", "optax_transform", "factory"],
)
def test_metrics_of_a_transform_is_a_type_error(thing: Any) -> None:
    with pytest.raises(TypeError, match=r"optimizer state.*tx\.init\(params\)"):
        clipjax.metrics(thing)


@pytest.mark.parametrize(
    "state",
    [optax.adam(1e-3).init(PARAMS), (), {}, None, optax.EmptyState()],
    ids=["adam", "tuple", "dict", "none", "empty"],
)
def test_metrics_without_clipjax_state_warns_and_returns_nothing(state: Any) -> None:
    with pytest.warns(UserWarning, match="no clipjax state") as record:
        assert clipjax.metrics(state) == {}
    # Attributed to the caller, so the default filter shows it once per calling line.
    assert record[0].filename == __file__


def test_metrics_without_clipjax_state_warns_once_per_calling_line() -> None:
    state = optax.adam(1e-3).init(PARAMS)
    with warnings.catch_warnings(record=True) as record:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for _ in range(5):
            clipjax.metrics(state)
    assert len(record) == 1


def test_metrics_with_a_clipjax_state_does_not_warn() -> None:
    tx = optax.chain(clipjax.autoclip(), optax.adam(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clipjax.metrics(tx.init(PARAMS))


# --- integer leaves ------------------------------------------------------------------------

ELEMENTWISE: dict[str, Callable[[], Any]] = {
    "clip_by_value": lambda: clipjax.clip_by_value(1.5),
    "clip_by_value_int_bound": lambda: clipjax.clip_by_value(2),
    "clip_by_percentile": lambda: clipjax.clip_by_percentile(50.0),
    "normalize_per_param": lambda: clipjax.normalize_per_param(),
    "zscore_normalize": lambda: clipjax.zscore_normalize(),
}


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_])
@pytest.mark.parametrize("case", sorted(ELEMENTWISE))
def test_integer_leaf_is_refused_naming_it(case: str, dtype: Any) -> None:
    tree = {"params": {"v": jnp.ones((4, 3)), "steps": jnp.array([1, -3, 2]).astype(dtype)}}
    tx = ELEMENTWISE[case]()
    state = tx.init(tree)
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError, match=r"gradient leaf params/steps has dtype") as info:
            update(tree, state)
        assert np.dtype(dtype).name in str(info.value)
        assert "optax.masked" in str(info.value)


@pytest.mark.parametrize("case", sorted(ELEMENTWISE))
def test_integer_leaf_left_out_by_masked_passes(case: str) -> None:
    tree = {"v": jnp.array([3.0, -4.0]), "steps": jnp.array([1, -3, 2], jnp.int32)}
    tx = optax.masked(ELEMENTWISE[case](), {"v": True, "steps": False})
    out, _ = tx.update(tree, tx.init(tree))
    np.testing.assert_array_equal(out["steps"], tree["steps"])
    assert out["steps"].dtype == jnp.int32

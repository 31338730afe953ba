"""Issues 18 and 37: careless input (zero bounds, scope callables, integer leaves, another
model's or transform's state, metrics of what is no state) gets an error that names it."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.paths import ROOT
from tests.registry import ALL_IDS, CASES

PARAMS = {
    "params": {
        "Dense_0": {"kernel": jnp.arange(12.0).reshape(3, 4) / 10, "bias": jnp.full((4,), 0.5)},
        "Dense_1": {"kernel": jnp.arange(8.0).reshape(4, 2) / 5 - 0.7, "bias": jnp.ones((2,))},
    }
}


def grads(scale: float = 3.0) -> Any:
    return jax.tree.map(lambda p: scale * (p + 0.1), PARAMS)


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
    out = lambda tx: tx.update(g, tx.init(g))[0]
    jax.tree.map(
        np.testing.assert_array_equal, out(clipjax.clip_by_value(-0.5)), out(optax.clip(0.5))
    )
    ours, ref = out(clipjax.clip_by_global_norm(-1.0, eps=0.0)), out(optax.clip_by_global_norm(1.0))
    jax.tree.map(lambda o, r: np.testing.assert_allclose(o, r, rtol=1e-6), ours, ref)


def test_injected_bound_is_checked_only_when_concrete() -> None:
    tx = optax.inject_hyperparams(clipjax.clip_by_value)(max_abs=lambda count: 1.0 / (count + 1))
    out, _ = tx.update(grads(), tx.init(PARAMS))
    assert float(jnp.max(jnp.abs(out["params"]["Dense_0"]["kernel"]))) == 1.0


# The factories that take a scope, and their required arguments.
SCOPED = dict.fromkeys(["autoclip", "zclip", "zscore_clip", "hist_clip", "agc", "adagc"], ())
SCOPED |= {"clip_by_value": (1.0,), "clip_by_percentile": (90.0,)}


def scoped(case: str, scope: Any) -> Any:
    return getattr(clipjax, case)(*SCOPED[case], scope=scope)


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
        scoped(case, scope)
    assert "<lambda>" in str(info.value)


@pytest.mark.parametrize("case", sorted(SCOPED))
def test_scope_callables_of_two_arguments_are_accepted(case: str) -> None:
    def by_layer(path: Any, leaf: Any, suffix: str = "") -> str:
        return clipjax.path_name(path[:-1]) + suffix

    for scope in (by_layer, lambda *args: clipjax.path_name(args[0][:-1])):
        tx = scoped(case, scope)
        state = tx.init(PARAMS)
        tx.update(grads(), state, PARAMS)
        assert state.info.groups == ("params/Dense_0", "params/Dense_1")


CHAIN = optax.chain(clipjax.zclip(), optax.adam(1e-3))


@pytest.mark.parametrize(
    "thing",
    [clipjax.autoclip(), CHAIN, optax.adam(1e-3), clipjax.autoclip],
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
    assert record[0].filename == __file__  # so the default filter shows it once per line


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


ELEMENTWISE: dict[str, Callable[[], Any]] = {
    "clip_by_value": partial(clipjax.clip_by_value, 1.5),
    "clip_by_value_int_bound": partial(clipjax.clip_by_value, 2),
    "clip_by_percentile": partial(clipjax.clip_by_percentile, 50.0),
} | {name: getattr(clipjax, name) for name in ("normalize_per_param", "zscore_normalize")}


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


def three_layers() -> Any:
    out = jax.tree.map(lambda x: x, PARAMS)
    out["params"]["Dense_2"] = {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros((2,))}
    return out


def restore_error(saved: Any, target: Any) -> str:
    """The message of flax's refusal to restore ``saved`` into ``target``."""
    serialization = pytest.importorskip("flax.serialization")
    with pytest.raises(ValueError, match="do not match") as info:
        serialization.from_bytes(target, serialization.to_bytes(saved))
    return str(info.value)


@pytest.mark.parametrize("chained", [False, True], ids=["alone", "in_chain"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: clipjax.autoclip(scope="per_layer"),
        lambda: clipjax.zclip(warmup_steps=2, scope="per_param", name="my_zclip"),
        lambda: clipjax.clip_by_value(1.0, scope="per_layer"),
    ],
    ids=["autoclip_per_layer", "named_zclip_per_param", "clip_by_value_per_layer"],
)
def test_restore_into_another_model_names_the_transform_and_the_trees(
    make: Callable[[], Any], chained: bool
) -> None:
    clipper = make()
    tx = optax.chain(clipper, optax.adam(1e-3)) if chained else clipper
    who = clipper.init(PARAMS).info
    who = who.name or who.algo
    groups = {"autoclip": (2, 3), "my_zclip": (4, 6), "clip_by_value": (2, 3)}[who]
    for saved, target, (n_saved, n_target), (l_saved, l_target) in (
        (PARAMS, three_layers(), groups, (4, 6)),
        (three_layers(), PARAMS, groups[::-1], (6, 4)),
    ):
        message = restore_error(tx.init(saved), tx.init(target))
        assert message.startswith(f"{who}: the checkpointed state")
        assert ("at ./0 " in message) == chained
        assert f"checkpoint holds a state for {n_saved} groups and {l_saved} leaves" in message
        assert f"tree of {n_target} groups (params/Dense_0" in message
        assert f"and {l_target} leaves" in message
        assert "leaf_index" not in message


def test_restore_from_another_transform_names_both_state_classes() -> None:
    """0.4 said 'a state for 1 group, the target ... a tree of 1 group': true of both."""
    message = restore_error(
        optax.chain(clipjax.zclip(), optax.adam(1e-3)).init(PARAMS),
        optax.chain(clipjax.autoclip(), optax.adam(1e-3)).init(PARAMS),
    )
    assert message.startswith("autoclip: the checkpointed state at ./0 and the restore target")
    assert "the checkpoint holds a ZClipState, the target is an AutoClipState" in message


def test_restore_of_a_0_4_recommended_checkpoint_names_the_start_rule() -> None:
    """0.4's zclip(feedback="clipped") kept a `weight` metric, today's a `held` one."""
    old = optax.chain(clipjax.zclip(feedback="clipped", start="weight"), optax.adam(1e-3))
    new = optax.chain(clipjax.zclip(feedback="clipped"), optax.adam(1e-3))
    serialization = pytest.importorskip("flax.serialization")
    message = restore_error(old.init(PARAMS), new.init(PARAMS))
    assert "both are a ZClipState" in message and "['weight'] where the target's" in message
    assert "start='weight'" in message
    data = serialization.to_bytes(old.init(PARAMS))
    assert "weight" in serialization.from_bytes(old.init(PARAMS), data)[0].metrics


def test_restore_of_other_groups_names_them_at_update() -> None:
    """Same leaves in the same order, three groups instead of two: flax restores a trained
    state, the first ``update`` refuses it."""
    serialization = pytest.importorskip("flax.serialization")
    tx = clipjax.zclip(warmup_steps=2, scope="per_layer")
    p = PARAMS["params"]
    regrouped = {"A": {"k": p["Dense_0"]["kernel"]}, "B": {"b": p["Dense_0"]["bias"]}}
    regrouped = {"params": {**regrouped, "C": dict(p["Dense_1"])}}
    state = tx.init(PARAMS)
    for t in range(3):
        _, state = tx.update(grads(1.0 + t), state)
    restored = serialization.from_bytes(tx.init(regrouped), serialization.to_bytes(state))
    assert restored.metrics["count"].shape == (2,)  # two layers' statistics, three groups
    shape = r"has shape \(2,\), expected \[3\].*another model"
    with pytest.raises(ValueError, match=shape) as info:
        tx.update(regrouped, restored)
    assert "zclip: the state does not fit" in str(info.value)
    assert "(params/A, params/B, params/C)" in str(info.value)


MULTI_GROUP: dict[str, Callable[[], Any]] = {
    "autoclip_per_layer": lambda: clipjax.autoclip(scope="per_layer"),
    "zclip_per_param": lambda: clipjax.zclip(warmup_steps=1, scope="per_param"),
    "hist_clip_nested": lambda: clipjax.hist_clip(
        warmup_steps=2,
        scope="per_param",
        warmup_clip=clipjax.clip_by_global_norm(1.0, scope="per_param"),
    ),
    "agc_unitwise": lambda: clipjax.agc(0.01),
    "agc_per_layer": lambda: clipjax.agc(0.01, scope="per_layer"),
    "adagc": lambda: clipjax.adagc(),
    "clip_by_value": lambda: clipjax.clip_by_value(0.5, scope="per_param"),
    "clip_by_percentile": lambda: clipjax.clip_by_percentile(50.0),
    "normalize_per_param": lambda: clipjax.normalize_per_param(),
    "zscore_normalize": lambda: clipjax.zscore_normalize(),
    "leaf_norms": lambda: clipjax.clip_by_global_norm(1.0, leaf_norms=True),
}


@pytest.mark.parametrize("case", sorted(MULTI_GROUP))
def test_tree_map_params_keeps_names_and_metrics(case: str) -> None:
    tx = optax.chain(MULTI_GROUP[case](), optax.adam(1e-3))
    state = tx.init(PARAMS)
    for t in range(3):
        _, state = tx.update(grads(1.0 + t), state, PARAMS)
    expected = clipjax.metrics(state)
    assert len(expected) > 8
    mapped = optax.tree_utils.tree_map_params(tx, lambda p: p, state)
    assert jax.tree.structure(mapped) == jax.tree.structure(state)
    assert mapped[0].info == state[0].info
    got = clipjax.metrics(mapped)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    # update accepts the mapped state, eagerly and under jit, and steps as from the original.
    for update in (tx.update, jax.jit(tx.update)):
        out, new = update(grads(5.0), mapped, PARAMS)
        ref_out, ref_new = update(grads(5.0), state, PARAMS)
        jax.tree.map(np.testing.assert_array_equal, (out, new), (ref_out, ref_new))


def test_tree_map_params_maps_params_shaped_parts_only() -> None:
    tx = optax.chain(clipjax.autoclip(scope="per_layer"), optax.adam(1e-3))
    state = tx.init(PARAMS)
    mapped = optax.tree_utils.tree_map_params(tx, lambda p: p + 1.0, state)
    # adam's moments are the params' shape and were mapped; the clipper's state was not.
    np.testing.assert_array_equal(mapped[1][0].mu["params"]["Dense_1"]["bias"], np.ones(2))
    assert clipjax.metrics(mapped).keys() == clipjax.metrics(state).keys()
    tx.update(grads(), mapped, PARAMS)


# Issue 37: the wrong state used to fail deep inside the arithmetic ("not enough
# values to unpack (expected 4, got 1)", "'dict' object has no attribute 'info'").
SMALL = {"w": jnp.ones(3), "b": jnp.ones(2)}
EVERY_UPDATE: dict[str, Callable[[], Any]] = {name: CASES[name].make for name in ALL_IDS} | {
    "skip_on_spike": lambda: clipjax.skip_on_spike(clipjax.adamw(1e-3), window_size=4),
    "adam": lambda: clipjax.adam(1e-3),
    "adamw_update_clipping": lambda: clipjax.adamw(1e-3, update_clipping=True),
    "chain": lambda: clipjax.chain(clipjax.zclip(), clipjax.adamw(1e-3)),
}


def without_target(node: Any) -> Any:
    """What a checkpoint restore without a target gives: named tuples as dicts."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return {f: without_target(getattr(node, f)) for f in node._fields if f != "info"}
    if isinstance(node, (tuple, list)):
        return [without_target(x) for x in node]
    if isinstance(node, dict):
        return {k: without_target(v) for k, v in node.items()}
    return node


def test_another_transforms_state_names_both() -> None:
    """The issue's example: autoclip given zclip's state."""
    with pytest.raises(
        TypeError, match=r"autoclip.update expects the AutoClipState .* got a ZClipState"
    ) as info:
        clipjax.autoclip().update(SMALL, clipjax.zclip().init(SMALL))
    assert "optax.chain" in str(info.value)
    with pytest.raises(TypeError, match=r"got an AutoClipState \(the state of clipjax.autoclip"):
        clipjax.zclip().update(SMALL, clipjax.autoclip().init(SMALL))


@pytest.mark.parametrize("name", sorted(EVERY_UPDATE))
def test_every_update_names_a_restored_dict_and_another_transforms_state(name: str) -> None:
    tx = EVERY_UPDATE[name]()
    restored = without_target(tx.init(SMALL))
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(TypeError, match=r"restored without a target") as info:
            update(SMALL, restored, SMALL)
        assert "tx.init(params)" in str(info.value)
    other = clipjax.agc() if name.startswith("clip_by_global_norm") else None
    other = other or clipjax.clip_by_global_norm(1.0)
    with pytest.raises(TypeError, match=r"\.update expects .* got an? \w+State \(the state of"):
        tx.update(SMALL, other.init(SMALL), SMALL)


def test_orbax_restore_without_a_target_says_how_to_restore(tmp_path: Any) -> None:
    """The issue's example: orbax without a target, then update and metrics."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = optax.chain(clipjax.zclip(warmup_steps=2), optax.adam(1e-3))
    _, state = tx.update(SMALL, tx.init(SMALL), SMALL)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"zclip.update .* got a dict.*without a target.*init"):
        tx.update(SMALL, restored, SMALL)
    with pytest.warns(UserWarning, match=r"restored without a target.*tx\.init\(params\)"):
        assert clipjax.metrics(restored) == {}


def test_a_state_of_other_settings_is_named() -> None:
    """Right class, other layout: an auto-mode state given to a percentile-mode autoclip."""
    with pytest.raises(ValueError, match=r"autoclip.update: the state's 'median' field has"):
        clipjax.autoclip(mode="percentile").update(SMALL, clipjax.autoclip().init(SMALL))
    with pytest.raises(ValueError, match=r"'window' field .*\(1, 1024\).*\(1, 10\)"):
        tx = clipjax.autoclip(mode="percentile", window_size=10)
        tx.update(SMALL, clipjax.autoclip(mode="percentile").init(SMALL))
    layout = r"'metrics' field .*has \['capped', 'capped_count', 'headroom'\]"
    with pytest.raises(ValueError, match=layout):
        clipjax.zclip(max_grad_norm=None).update(SMALL, clipjax.zclip().init(SMALL))


def test_metrics_of_an_nnx_optimizer_without_clipjax_says_so() -> None:
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.warns(UserWarning, match=r"holds no clipjax transform") as record:
        assert clipjax.metrics(optimizer) == {}
    assert "nnx.state" not in str(record[0].message)
    with pytest.warns(UserWarning, match=r"holds no clipjax transform's state"):
        assert clipjax.metrics(nnx.state(optimizer)) == {}


@pytest.mark.parametrize("flat", ["yes", 1, 0, None, "False"])
def test_metrics_flat_must_be_a_bool(flat: Any) -> None:
    """Issue 37: metrics(state, flat="yes") was accepted (a truthy string)."""
    state = clipjax.zclip().init(SMALL)
    with pytest.raises(TypeError, match=r"flat must be a bool"):
        clipjax.metrics(state, flat=flat)
    assert clipjax.metrics(state, flat=np.bool_(False)).keys() == {"zclip"}


def migrating_errors() -> list[tuple[str, str]]:
    """``(call, exception name)`` of each row of the errors table in docs/migrating.md."""
    text = (ROOT / "docs" / "migrating.md").read_text()
    text = text.split("## Errors that name the mistake", 1)[1].split("\n## ", 1)[0]
    rows = [re.fullmatch(r"\| (.+) \| `(\w+Error)`: .* \|", line) for line in text.splitlines()]
    return [(c, m.group(2)) for m in rows if m for c in re.findall(r"`([^`]+)`", m.group(1))]


MIGRATING_ERRORS = migrating_errors()


def test_the_errors_table_is_read() -> None:
    assert len(MIGRATING_ERRORS) >= 25


@pytest.mark.parametrize(("call", "error"), MIGRATING_ERRORS, ids=[c for c, _ in MIGRATING_ERRORS])
def test_every_error_the_migration_page_lists_is_raised(call: str, error: str) -> None:
    expected = {"ValueError": ValueError, "TypeError": TypeError}[error]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(expected):
            eval(call, {"clipjax": clipjax, "optax": optax, "jnp": jnp})

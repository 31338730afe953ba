"""Checkpoints (flax, orbax, nnx.Optimizer) of every clipper resume bit-identically, compile
once, and refuse another model's state; docs/checkpointing.md runs as written.

A clipjax state's ``GroupInfo`` has no array leaves: a restore takes it from the target, so
the target must come from ``tx.init`` on the same model."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.paths import ROOT

ocp = pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint")
pytest.importorskip("flax", reason="needs flax")
from flax import nnx, serialization

import clipjax
from tests.model import HIDDEN, IN, OUT, batches, mlp_params, train_step
from tests.registry import all_clippers
from tests.trees import assert_trees_equal

TOTAL, SPLIT = 8, 4  # steps in all; the checkpoint is taken after SPLIT steps


@functools.cache
def training() -> dict[str, Any]:
    """An uninterrupted run, and the (params, opt_state) after ``SPLIT`` steps."""
    tx = optax.chain(all_clippers(), optax.adam(1e-2))
    step = jax.jit(train_step(tx))
    data = list(batches(TOTAL))
    params, opt_state = mlp_params(), tx.init(mlp_params())
    middle = None
    for t, batch in enumerate(data):
        if t == SPLIT:
            middle = (params, opt_state)
        params, opt_state, _ = step(params, opt_state, batch)
    return {"tx": tx, "step": step, "data": data, "middle": middle, "final": (params, opt_state)}


def target() -> tuple[Any, Any]:
    """A fresh ``(params, opt_state)`` of the same model: the restore target."""
    return mlp_params(seed=1), training()["tx"].init(mlp_params(seed=1))


def check_resumed(restored: tuple[Any, Any]) -> None:
    run = training()
    assert jax.tree.structure(restored) == jax.tree.structure(run["middle"])
    assert_trees_equal(restored, run["middle"], "restored state")
    params, opt_state = restored
    for batch in run["data"][SPLIT:]:
        params, opt_state, _ = run["step"](params, opt_state, batch)
    assert_trees_equal((params, opt_state), run["final"], "resumed run")
    m, expected = clipjax.metrics(opt_state), clipjax.metrics(run["final"][1])
    assert m.keys() == expected.keys() and len(m) > 0
    assert int(m["zclip/global/step"]) == TOTAL


def orbax_round_trip(path: Path, state: Any, target: Any) -> Any:
    """``state`` saved with orbax's StandardCheckpointer, restored as ``target``'s shapes."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        return checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, target))


def test_flax_serialization_resumes_bit_identically() -> None:
    data = serialization.to_bytes(training()["middle"])
    check_resumed(serialization.from_bytes(target(), data))


def test_flax_state_dict_holds_no_group_info() -> None:
    state_dict = serialization.to_state_dict(training()["middle"][1])
    zclip_state = state_dict["0"]["zclip"]
    assert zclip_state["info"] == {}  # static: restored from the target
    assert set(zclip_state["metrics"]) >= {"grad_norm", "threshold", "scale", "count"}


def test_orbax_standard_checkpointer_resumes_bit_identically(tmp_path: Path) -> None:
    check_resumed(orbax_round_trip(tmp_path / "ckpt", training()["middle"], target()))


def test_orbax_pytree_checkpointer_resumes_bit_identically(tmp_path: Path) -> None:
    item = target()
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", training()["middle"])
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        restored = checkpointer.restore(tmp_path / "ckpt", item=item, restore_args=restore_args)
    check_resumed(restored)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


# A few clippers keep this test short; the tests above cover every clipper.
NNX_CLIPPERS = ["autoclip", "hist_clip", "zclip_per_layer"]


def nnx_pair(seed: int) -> tuple[Model, nnx.Optimizer]:
    model = Model(nnx.Rngs(seed))
    tx = optax.chain(all_clippers(NNX_CLIPPERS), optax.adam(1e-2))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def nnx_step(model: Model, opt: nnx.Optimizer, batch: Any) -> None:
    x, y = batch
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)


def test_nnx_optimizer_orbax_resumes_bit_identically(tmp_path: Path) -> None:
    data = list(batches(TOTAL))
    model, opt = nnx_pair(0)
    for batch in data:
        nnx_step(model, opt, batch)
    expected = nnx.state((model, opt))

    model, opt = nnx_pair(0)
    for batch in data[:SPLIT]:
        nnx_step(model, opt, batch)
    new_model, new_opt = nnx_pair(1)  # other weights, same structure
    restored = orbax_round_trip(
        tmp_path / "nnx", nnx.state((model, opt)), nnx.state((new_model, new_opt))
    )
    nnx.update((new_model, new_opt), restored)
    for batch in data[SPLIT:]:
        nnx_step(new_model, new_opt, batch)
    assert_trees_equal(nnx.state((new_model, new_opt)), expected, "resumed nnx run")
    assert int(clipjax.metrics(new_opt.opt_state)["hist_clip/global/step"]) == TOTAL


def test_orbax_restore_of_a_placed_state_does_not_recompile_the_step(tmp_path: Path) -> None:
    # orbax restores committed arrays; a state placed with device_put before the
    # first step presents the same arguments to jit before and after the restore.
    tx = optax.chain(all_clippers(NNX_CLIPPERS), optax.adam(1e-2))
    step = jax.jit(train_step(tx))
    data = list(batches(TOTAL))
    device = jax.devices()[0]
    params, opt_state = jax.device_put((mlp_params(), tx.init(mlp_params())), device)
    for batch in data[:SPLIT]:
        params, opt_state, _ = step(params, opt_state, batch)
    state = (params, opt_state)
    params, opt_state = orbax_round_trip(tmp_path / "ckpt", state, (params, tx.init(params)))
    for batch in data[SPLIT : SPLIT + 5]:
        params, opt_state, _ = step(params, opt_state, batch)
    assert step._cache_size() == 1


@pytest.mark.slow
def test_unplaced_state_recompiles_after_an_orbax_restore(tmp_path: Path) -> None:
    # The cause the docs name: without the placement, the restored (committed)
    # arguments differ from tx.init's (uncommitted) ones and jit compiles again.
    tx = optax.chain(clipjax.zclip(warmup_steps=2), optax.adam(1e-2))
    step = jax.jit(train_step(tx))
    data = list(batches(SPLIT + 5))
    params, opt_state = mlp_params(), tx.init(mlp_params())
    for batch in data[:SPLIT]:
        params, opt_state, _ = step(params, opt_state, batch)
    assert not any(leaf.committed for leaf in jax.tree.leaves(opt_state))
    state = (params, opt_state)
    params, opt_state = orbax_round_trip(tmp_path / "ckpt", state, state)
    assert all(leaf.committed for leaf in jax.tree.leaves(opt_state))
    for batch in data[SPLIT:]:
        params, opt_state, _ = step(params, opt_state, batch)
    assert step._cache_size() == 2


@pytest.mark.slow
def test_checkpointing_page_runs_and_compiles_each_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = ROOT / "docs" / "checkpointing.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)  # the page saves under ./checkpoints
    plain: dict[str, Any] = {}
    exec(compile(blocks[0], f"{page}:plain", "exec"), plain)  # then: one compilation
    assert plain["train_step"]._cache_size() == 1
    assert int(clipjax.metrics(plain["opt_state"])["zclip/hidden/step"]) == 15
    nnx_page: dict[str, Any] = {}
    exec(compile(blocks[1], f"{page}:nnx", "exec"), nnx_page)
    assert nnx_page["train_step"].jitted_fn._cache_size() == 1
    assert int(clipjax.metrics(nnx_page["optimizer"].opt_state)["zclip/hidden/step"]) == 15
    assert os.path.isdir(tmp_path / "checkpoints" / "nnx_step_10")


def three_layers() -> dict[str, Any]:
    params = mlp_params()
    params["params"]["Dense_2"] = {"kernel": jnp.ones((OUT, OUT)), "bias": jnp.zeros((OUT,))}
    return params


def trained_state(tx: optax.GradientTransformation, params: Any) -> Any:
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(3):
        _, state = update(jax.tree.map(lambda p, f=t + 1.0: p * f, params), state, params)
    return state


@pytest.mark.parametrize("chained", [False, True], ids=["alone", "in_chain"])
def test_flax_restore_of_another_models_state_fails(chained: bool) -> None:
    clipper = clipjax.zclip(warmup_steps=2, scope="per_layer")
    tx = optax.chain(clipper, optax.adam(1e-2)) if chained else clipper
    small, big = mlp_params(), three_layers()
    # A target with a layer the checkpoint lacks: flax refuses at restore.
    data = serialization.to_bytes(trained_state(tx, small))
    with pytest.raises(ValueError, match="do not match"):
        serialization.from_bytes(tx.init(big), data)
    # A checkpoint with a layer the target lacks: refused at restore (another tree), or at the
    # first update ([groups] arrays of another length: flax does not compare array shapes).
    data = serialization.to_bytes(trained_state(tx, big))
    try:
        restored = serialization.from_bytes(tx.init(small), data)
    except ValueError as error:
        assert re.search(r"do not match|shape", str(error)), error
        return
    with pytest.raises(ValueError, match=r"another model|does not match"):
        tx.update(small, restored, small)


def test_flax_restore_of_a_global_state_into_another_model_is_allowed() -> None:
    """One group either way: the global statistics are scalars and carry over."""
    tx = clipjax.zclip(warmup_steps=2)
    saved = trained_state(tx, three_layers())
    restored = serialization.from_bytes(tx.init(mlp_params()), serialization.to_bytes(saved))
    assert restored.info.groups == ("global",)
    np.testing.assert_array_equal(restored.mean, saved.mean)
    tx.update(mlp_params(), restored)


def test_orbax_restore_of_another_models_state_fails_at_restore(tmp_path: Path) -> None:
    tx = clipjax.hist_clip(warmup_steps=2, scope="per_layer")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", trained_state(tx, mlp_params()))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(three_layers()))
    with (
        ocp.StandardCheckpointer() as checkpointer,
        pytest.raises(ValueError, match="do not match"),
    ):
        checkpointer.restore(tmp_path / "ckpt", abstract)
    # (A tree of the same structure whose [groups] arrays differ in length fails
    # too, "Requested shape (3,) is not compatible with the stored shape (2,)",
    # but orbax 0.12 then leaves coroutines behind that warn at exit.)

"""``jax.jit`` over sharded arrays on 8 devices, data parallel (parameters replicated) and
FSDP-style (every parameter and its gradient split along its first dimension): updates,
parameters, metrics and clipjax states equal one device within ``trees.RTOL``; the clipjax
state stays replicated with one sharding and the step compiles once."""

from __future__ import annotations

import functools
from typing import Any

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipjax
from tests.model import batches, mlp_params, train_step
from tests.parallel.reference import STEPS, mesh, single_device_run, state_sharding
from tests.registry import CLIPPER_IDS, all_clippers, optimizer
from tests.trees import assert_trees_close

MODES = ("data_parallel", "fsdp")


@functools.cache
def sharded_run(mode: str) -> dict[str, Any]:
    """Trains :func:`registry.all_clippers` with sharded arrays; per-step results on the host."""
    m = mesh("data")
    replicated = NamedSharding(m, P())
    params = mlp_params()
    if mode == "fsdp":
        # P("data"), not P("data", None): jit returns the shorter spelling and an
        # input spelled otherwise compiles the step a second time.
        param_sharding = jax.tree.map(lambda _: NamedSharding(m, P("data")), params)

        def constrain(grads: Any) -> Any:
            return jax.lax.with_sharding_constraint(grads, param_sharding)

    else:
        param_sharding = jax.tree.map(lambda _: replicated, params)
        constrain = None
    tx = optimizer(all_clippers())
    params = jax.device_put(params, param_sharding)
    state = jax.jit(tx.init, out_shardings=state_sharding(tx, params, param_sharding, replicated))(
        params
    )
    step = jax.jit(train_step(tx, constrain))
    batch_sharding = NamedSharding(m, P("data"))
    out: dict[str, Any] = {"steps": [], "shardings": [], "param_shardings": []}
    shardings = [[x.sharding for x in jax.tree.leaves(state[0])]]
    for batch in batches(STEPS):
        params, state, updates = step(params, state, jax.device_put(batch, batch_sharding))
        shardings.append([x.sharding for x in jax.tree.leaves(state[0])])
        out["steps"].append(jax.device_get((params, state, updates)))
    out["shardings"] = shardings
    out["param_shardings"] = [x.sharding for x in jax.tree.leaves(params)]
    out["compiled"] = step._cache_size()
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLIPPER_IDS)
def test_sharded_state_equals_one_device(mode: str, name: str) -> None:
    for t, ((_, state, _), (_, ref_state, _)) in enumerate(
        zip(sharded_run(mode)["steps"], single_device_run())
    ):
        assert_trees_close(state[0][name], ref_state[0][name], what=f"{mode} {t}: ")
        mine, ref = clipjax.metrics(state[0][name]), clipjax.metrics(ref_state[0][name])
        assert mine.keys() == ref.keys()


@pytest.mark.parametrize("mode", MODES)
def test_sharded_updates_and_params_equal_one_device(mode: str) -> None:
    for t, ((params, _, updates), (ref_params, _, ref_updates)) in enumerate(
        zip(sharded_run(mode)["steps"], single_device_run())
    ):
        assert_trees_close(updates, ref_updates, what=f"{mode} step {t} updates")
        assert_trees_close(params, ref_params, what=f"{mode} step {t} params")
    spike = clipjax.metrics(sharded_run(mode)["steps"][5][1])
    assert bool(spike["zclip/global/clipped"])


@pytest.mark.parametrize("mode", MODES)
def test_clipjax_state_stays_replicated_with_a_stable_sharding(mode: str) -> None:
    run = sharded_run(mode)
    first = run["shardings"][0]
    assert all(s.is_fully_replicated for s in first)
    assert all(len(s.device_set) == 8 for s in first)
    for t, shardings in enumerate(run["shardings"][1:]):
        for a, b in zip(shardings, first):
            assert a.is_fully_replicated and a == b, f"step {t}: {a} != {b}"
    assert run["compiled"] == 1  # one compilation for every step


def test_fsdp_really_shards_the_parameters() -> None:
    for s in sharded_run("fsdp")["param_shardings"]:
        assert not s.is_fully_replicated and s.spec[0] == "data"

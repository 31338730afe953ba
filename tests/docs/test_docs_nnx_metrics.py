"""What the docs promise flax NNX users of ``clipjax.metrics``: it reads
``optimizer.opt_state``, the ``nnx.Optimizer`` itself and whatever
``nnx.split(optimizer)`` returns, with the same names and values; given
``nnx.state(optimizer)`` alone (which keeps no group names) it says what to
pass instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

nnx = pytest.importorskip("flax.nnx", reason="needs flax")


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


@pytest.fixture(scope="module")
def optimizer():
    model = MLP(nnx.Rngs(0))
    tx = optax.chain(clipjax.zclip(warmup_steps=2, scope="per_layer"), optax.adam(1e-2))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 1))
    for scale in (1.0, 1.0, 1.0, 100.0):
        target = scale * (y + 1)
        grads = nnx.grad(lambda m, target=target: jnp.mean((m(x) - target) ** 2))(model)
        opt.update(model, grads)
    return opt


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_every_nnx_form_gives_the_opt_state_metrics(optimizer) -> None:
    expected = clipjax.metrics(optimizer.opt_state)
    assert {"zclip/hidden/grad_norm", "zclip/out/threshold"} <= set(expected)
    assert int(expected["zclip/hidden/step"]) == 4
    same(clipjax.metrics(optimizer), expected)
    same(clipjax.metrics(nnx.split(optimizer)), expected)
    same(clipjax.metrics(nnx.split(optimizer, nnx.Param, ...)), expected)


def test_a_split_optimizer_is_read_inside_jit(optimizer) -> None:
    graphdef, state = nnx.split(optimizer)
    read = jax.jit(lambda state: clipjax.metrics((graphdef, state)))
    same(read(state), clipjax.metrics(optimizer.opt_state))


def test_nnx_state_alone_says_what_to_pass(optimizer) -> None:
    with pytest.warns(UserWarning, match=r"nnx\.state\(\) keeps no group names.*nnx\.split"):
        assert clipjax.metrics(nnx.state(optimizer)) == {}

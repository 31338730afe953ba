"""clipjax.qk_clip on 4 devices: sharded jit (batch and heads split over the mesh) and
shard_map with ``axis_name``, each against the same steps on one device."""

from __future__ import annotations

import pytest

from tests import scripts

# Slow, `make test` skips it: starts a subprocess with 4 CPU devices and compiles three steps.
pytestmark = pytest.mark.slow

SCRIPT = r"""
import functools
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import clipjax

assert jax.device_count() == 4, jax.devices()
D, H, HD, L, B, T = 8, 4, 2, 2, 8, 6
keys = iter(jax.random.split(jax.random.key(0), 8))
normal = lambda *s: jax.random.normal(next(keys), s)
params = {"layers": {"attn": {"query": {"kernel": normal(L, D, H, HD)},
                              "key": {"kernel": normal(L, D, H, HD)},
                              "value": {"kernel": normal(L, D, H, HD)}}},
          "out": normal(D, D)}
x = jax.random.normal(jax.random.key(1), (B, T, D))

def loss_fn(params, x):
    def layer(h, p):
        project = lambda n: jnp.einsum("btd,dhk->bthk", h, p["attn"][n]["kernel"])
        q, k, v = (project(n) for n in ("query", "key", "value"))
        s = clipjax.max_attention_logits(q, k, causal=True, chunk_size=4)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(h.shape[:2] + (-1,))
        return jnp.tanh(h + out @ jnp.ones((H * HD, D))), s
    h, s = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean((h @ params["out"]) ** 2), s

def make(axis_name=None):
    return clipjax.qk_clip(
        optax.adamw(0.05), 2.0, scope=clipjax.stacked(layers="layers"), axis_name=axis_name)

def step(tx, params, state, x):
    (loss, s), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x)
    updates, state = tx.update(grads, state, params, max_logits=s)
    return optax.apply_updates(params, updates), state

def run(tx, stepper, params, x, n=3):
    state = tx.init(params)
    for _ in range(n):
        params, state = stepper(params, state, x)
    return params, state

tx = make()
want_params, want_state = run(tx, jax.jit(functools.partial(step, tx)), params, x)
assert int(jnp.sum(want_state.metrics["clipped_count"])) > 0

mesh = Mesh(np.array(jax.devices()), ("data",))
heads = NamedSharding(mesh, P(None, None, "data", None))  # [layers, d, heads, head_dim]
repl = NamedSharding(mesh, P())
param_sharding = jax.tree.map(lambda a: heads if a.ndim == 4 else repl, params)
sharded_params = jax.device_put(params, param_sharding)
sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
jitted = jax.jit(functools.partial(step, tx))
got_params, got_state = run(tx, jitted, sharded_params, sharded_x)
close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
jax.tree.map(close, got_params, want_params)
jax.tree.map(close, got_state.metrics, want_state.metrics)
assert got_params["layers"]["attn"]["query"]["kernel"].sharding.spec == heads.spec

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map
tx_mapped = make("data")

def mapped_step(params, state, x):
    (loss, s), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x)
    grads = jax.lax.pmean(grads, "data")
    updates, state = tx_mapped.update(grads, state, params, max_logits=s)
    return optax.apply_updates(params, updates), state

mapped = jax.jit(shard_map(mapped_step, mesh=mesh, in_specs=(P(), P(), P("data")),
                           out_specs=(P(), P())))
got_params, got_state = run(tx_mapped, mapped, params, sharded_x)
jax.tree.map(close, got_params, want_params)
jax.tree.map(close, got_state.metrics, want_state.metrics)
print("ok")
"""


def test_sharded_jit_and_shard_map_equal_one_device() -> None:
    proc = scripts.python("-c", SCRIPT, timeout=600, devices=4)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]

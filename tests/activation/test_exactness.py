"""clip_activation_gradient is the model's own gradient with the chosen tokens' output
gradients zeroed (or scaled) by hand: ``dL/dy`` from ``jax.vjp``, the tokens picked by the
float64 restatement (tests/activation/reference.py), pulled back through the layers below
with ``jax.vjp``. For several ``k``, both modes, ties, under ``jax.jit`` and inside a
``lax.scan`` over layers; ``k`` off by one gives other gradients. The statistics (the
gradient of the carrier) equal the restatement's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from tests.activation.reference import restated

FEATURES, HIDDEN = 6, 12
BATCH, TOKENS = 3, 10  # 30 tokens
# float32: the two paths round the same sums in other orders; ATOL is relative to the
# array's largest element (an element that nearly cancels has no relative precision).
RTOL, ATOL = 2e-6, 2e-6
STATS_RTOL = 1e-5  # float32 norms against float64 ones
PERCENTILES = (0, 25, 50, 90, 99.9, 100)


def init(seed: int = 0) -> dict[str, Any]:
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[0])
    below = {"w1": normal(FEATURES, HIDDEN), "b1": 0.1 * normal(HIDDEN),
             "w2": normal(HIDDEN, FEATURES), "b2": 0.1 * normal(FEATURES)}  # fmt: skip
    return {"below": below, "above": {"w3": normal(FEATURES, 3)}}


def data(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    kx, kt = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (BATCH, TOKENS, FEATURES))
    # Heavy-tailed scales per token: a few tokens' gradients stand out.
    x = x * jnp.exp(jax.random.normal(kt, (BATCH, TOKENS, 1)))
    return x, jax.random.normal(kt, (BATCH, TOKENS, 3))


def below(p: dict[str, Any], x: jax.Array) -> jax.Array:
    """The two-layer MLP whose output ``y`` the function is applied to."""
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def above(p: dict[str, Any], y: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((jnp.tanh(y) @ p["w3"] - target) ** 2)


def loss(params: Any, stats: Any, x: Any, target: Any, **settings: Any) -> jax.Array:
    y = clipjax.clip_activation_gradient(below(params["below"], x), stats, **settings)
    return above(params["above"], y, target)


def by_hand(
    params: Any, x: Any, target: Any, k: int, mode: str, percentiles: tuple = ()
) -> tuple[Any, dict[str, float]]:
    """The gradients with ``dL/dy``'s tokens clipped by the float64 restatement."""
    y, pull_below = jax.vjp(lambda p: below(p, x), params["below"])
    value, pull_above = jax.vjp(lambda p, y: above(p, y, target), params["above"], y)
    grad_above, grad_y = pull_above(jnp.ones_like(value))
    clipped, stats = restated(np.asarray(grad_y), k, mode, percentiles)
    (grad_below,) = pull_below(jnp.asarray(clipped, jnp.float32))
    return {"below": grad_below, "above": grad_above}, stats


def fields(stats_grad: clipjax.ActivationStats) -> dict[str, np.ndarray]:
    values = np.asarray(stats_grad.values)
    return {name: values[..., i] for i, name in stats_grad.layout.reported}


def assert_close(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    want = np.asarray(want)
    scale = float(np.max(np.abs(want), initial=0.0))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale)


def assert_trees_close(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    jax.tree.map(lambda a, b: assert_close(a, b, rtol, atol), got, want)


def assert_stats(got: dict[str, np.ndarray], want: dict[str, float]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, value in want.items():
        if name.endswith("_tokens"):
            assert float(got[name]) == value, name
        else:
            np.testing.assert_allclose(got[name], value, rtol=STATS_RTOL, err_msg=name)


@pytest.mark.parametrize("mode", ["zero", "clip"])
@pytest.mark.parametrize("k", [0, 1, 4, 29])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_are_the_model_with_the_tokens_clipped_by_hand(
    k: int, mode: str, jit: bool
) -> None:
    params, (x, target) = init(), data()
    settings = {"k": k, "mode": mode, "percentiles": PERCENTILES}
    stats = clipjax.activation_stats_init(k=k, percentiles=PERCENTILES)
    grad = jax.grad(lambda p, s: loss(p, s, x, target, **settings), argnums=(0, 1))
    got, stats_grad = (jax.jit(grad) if jit else grad)(params, stats)
    want, want_stats = by_hand(params, x, target, k, mode, PERCENTILES)
    assert_trees_close(got, want)
    assert_stats(fields(stats_grad), want_stats)
    if k:
        assert want_stats["clipped_tokens"] >= (k if mode == "zero" else 1)


@pytest.mark.parametrize("mode", ["zero", "clip"])
def test_k_off_by_one_gives_other_gradients(mode: str) -> None:
    """The negative control: the comparison above tells k from k - 1 and k + 1."""
    params, (x, target), k = init(), data(), 3
    stats = clipjax.activation_stats_init(k=k)
    got = jax.grad(loss)(params, stats, x, target, k=k, mode=mode)
    for other in (k - 1, k + 1):
        want, _ = by_hand(params, x, target, other, mode)
        gap = np.max(np.abs(np.asarray(got["below"]["w1"]) - np.asarray(want["below"]["w1"])))
        scale = np.max(np.abs(np.asarray(want["below"]["w1"])))
        assert gap > 100 * (RTOL + ATOL) * scale, (other, gap, scale)
    want, _ = by_hand(params, x, target, k, mode)
    assert_trees_close(got, want)


def tied_cotangent() -> np.ndarray:
    """``dL/dy`` with ties: token norms 10, 8, 8, 8, then below 5 (identical rows tie
    exactly in float32 too)."""
    rng = np.random.default_rng(0)
    c = rng.normal(size=(BATCH * TOKENS, FEATURES))
    c *= rng.uniform(1, 4, size=(len(c), 1)) / np.linalg.norm(c, axis=-1, keepdims=True)
    row = rng.normal(size=FEATURES)
    row /= np.linalg.norm(row)
    c[7], c[2], c[19], c[25] = 10 * row, 8 * row, 8 * row, 8 * row
    c[11] = 5 * rng.normal(size=FEATURES) / np.sqrt(FEATURES)
    return c.reshape(BATCH, TOKENS, FEATURES).astype(np.float32)


@pytest.mark.parametrize(
    ("k", "mode", "clipped"),
    [
        (2, "zero", 4),  # the 2nd largest is 8: the 10 and all three 8s are zeroed
        (3, "zero", 4),
        (4, "zero", 4),  # the 4th largest is the last 8
        (1, "clip", 1),  # the 10 scaled to 8
        (2, "clip", 1),  # the 10 scaled to 8: the tied 8s are the threshold
        (3, "clip", 1),
        (4, "clip", 4),  # the 10 and the 8s scaled to the 5th largest
    ],
)
def test_ties(k: int, mode: str, clipped: int) -> None:
    params, (x, _) = init(), data()
    c = jnp.asarray(tied_cotangent())
    stats = clipjax.activation_stats_init(k=k)

    def cotangent_loss(p: Any, s: Any) -> jax.Array:
        y = clipjax.clip_activation_gradient(below(p, x), s, k=k, mode=mode)
        return jnp.sum(y * c)  # dL/dy = c

    got, stats_grad = jax.jit(jax.grad(cotangent_loss, argnums=(0, 1)))(params["below"], stats)
    want_c, want_stats = restated(np.asarray(c), k, mode)
    _, pull = jax.vjp(lambda p: below(p, x), params["below"])
    (want,) = pull(jnp.asarray(want_c, jnp.float32))
    assert_trees_close(got, want)
    assert want_stats["clipped_tokens"] == clipped
    assert_stats(fields(stats_grad), want_stats)


LAYERS = 3


def stack_params(seed: int = 2) -> dict[str, jax.Array]:
    kw, kb, ko = jax.random.split(jax.random.key(seed), 3)
    return {
        "w": jax.random.normal(kw, (LAYERS, FEATURES, FEATURES)) / np.sqrt(FEATURES),
        "b": 0.1 * jax.random.normal(kb, (LAYERS, FEATURES)),
        "out": jax.random.normal(ko, (FEATURES, 3)) / np.sqrt(FEATURES),
    }


def layer(w: jax.Array, b: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w + b)


def stack_loss(params: Any, stats: Any, x: Any, target: Any, k: int, mode: str) -> jax.Array:
    def body(x: jax.Array, layer_in: Any) -> tuple[jax.Array, None]:
        w, b, s = layer_in
        y = clipjax.clip_activation_gradient(layer(w, b, x), s, k=k, mode=mode,
                                             percentiles=PERCENTILES)  # fmt: skip
        return x + y, None

    x, _ = jax.lax.scan(body, x, (params["w"], params["b"], stats))
    return jnp.mean((x @ params["out"] - target) ** 2)


def stack_by_hand(params: Any, x: Any, target: Any, k: int, mode: str) -> tuple[Any, list]:
    """The residual stack's backward pass, layer by layer, each ``dL/dy`` clipped by hand."""
    inputs, pulls = [], []
    for i in range(LAYERS):
        inputs.append(x)
        y, pull = jax.vjp(layer, params["w"][i], params["b"][i], x)
        pulls.append(pull)
        x = x + y
    value, pull_top = jax.vjp(lambda out, x: jnp.mean((x @ out - target) ** 2), params["out"], x)
    grad_out, grad_x = pull_top(jnp.ones_like(value))
    grads_w, grads_b, stats = [None] * LAYERS, [None] * LAYERS, [None] * LAYERS
    for i in reversed(range(LAYERS)):
        clipped, stats[i] = restated(np.asarray(grad_x), k, mode, PERCENTILES)
        grads_w[i], grads_b[i], through = pulls[i](jnp.asarray(clipped, jnp.float32))
        grad_x = grad_x + through  # the residual path and the layer's
    grads = {"w": jnp.stack(grads_w), "b": jnp.stack(grads_b), "out": grad_out}
    return grads, stats


@pytest.mark.parametrize(("k", "mode"), [(2, "zero"), (3, "clip"), (0, "zero")])
def test_inside_a_scan_over_layers_each_layer_has_its_row(k: int, mode: str) -> None:
    params, (x, target) = stack_params(), data()
    stats = clipjax.activation_stats_init(k=k, percentiles=PERCENTILES, layers=LAYERS)
    grad = jax.jit(jax.grad(stack_loss, argnums=(0, 1)), static_argnums=(4, 5))
    got, stats_grad = grad(params, stats, x, target, k, mode)
    want, want_stats = stack_by_hand(params, x, target, k, mode)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)  # three layers of rounding
    assert stats_grad.values.shape == (LAYERS, len(stats.layout.fields))
    got_stats = fields(stats_grad)
    for i in range(LAYERS):
        assert_stats({name: v[i] for name, v in got_stats.items()}, want_stats[i])
    # The metrics of a stacked carrier: one value per layer.
    m = clipjax.activation_metrics(stats_grad, name="stack")
    assert m["activation_grad/stack/top_norm"].shape == (LAYERS,)


def test_without_the_carrier_in_the_gradient_the_parameters_are_the_same() -> None:
    """``jax.grad`` with respect to the parameters only: the same parameter gradients."""
    params, (x, target) = init(), data()
    stats = clipjax.activation_stats_init(k=2)
    only = jax.jit(jax.grad(loss), static_argnames=("k", "mode"))(params, stats, x, target, k=2,
                                                                   mode="zero")  # fmt: skip
    both, _ = jax.grad(loss, argnums=(0, 1))(params, stats, x, target, k=2, mode="zero")
    assert_trees_close(only, both)


def test_the_forward_pass_is_the_identity() -> None:
    x = jax.random.normal(jax.random.key(3), (2, 4, 5))
    stats = clipjax.activation_stats_init(k=2)
    np.testing.assert_array_equal(clipjax.clip_activation_gradient(x, stats, k=2), x)
    y = jax.jit(lambda x: clipjax.clip_activation_gradient(x, stats, k=2, mode="clip"))(x)
    np.testing.assert_array_equal(y, x)

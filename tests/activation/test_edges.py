"""What clip_activation_gradient does at the edges: non-finite gradients, k at or above the
number of tokens, a carrier that does not fit, bfloat16 activations; how its statistics
are read (activation_metrics, clipjax.metrics); and clipjax without flax."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.activation.reference import restated
from tests.paths import ROOT


def pull(g: Any, k: int, mode: str = "zero", percentiles: Any = None) -> tuple[Any, Any]:
    """``(the gradient passed on, the carrier's gradient)`` for the output gradient ``g``."""
    g = jnp.asarray(g)
    stats = clipjax.activation_stats_init(k=k, percentiles=percentiles)
    clip = lambda y, s: clipjax.clip_activation_gradient(y, s, k=k, mode=mode,
                                                         percentiles=percentiles)  # fmt: skip
    return jax.vjp(clip, jnp.zeros_like(g), stats)[1](g)


def read(stats_grad: Any) -> dict[str, float]:
    return {
        k.rsplit("/", 1)[1]: float(v) for k, v in clipjax.activation_metrics(stats_grad).items()
    }


# ------------------------------------------------------------------------- non-finite


def nonfinite_gradient() -> np.ndarray:
    rng = np.random.default_rng(0)
    g = rng.normal(size=(2, 8, 4)).astype(np.float32)
    g[0, 1, 0] = np.nan
    g[1, 5, 3] = np.inf
    g[1, 6] = 1e20  # finite elements whose float32 sum of squares overflows
    return g


@pytest.mark.parametrize("mode", ["zero", "clip"])
def test_non_finite_tokens_are_zeroed_counted_and_left_out_of_the_statistics(mode: str) -> None:
    g = nonfinite_gradient()
    out, stats_grad = pull(g, 2, mode, percentiles=(50, 100))
    assert np.all(np.isfinite(out))
    assert not np.any(out[0, 1]) and not np.any(out[1, 5]) and not np.any(out[1, 6])
    got, (want_out, want) = read(stats_grad), restated(g, 2, mode, (50, 100))
    assert got["nonfinite_tokens"] == 3
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)


def test_a_parameter_gradient_stays_finite_behind_a_non_finite_token() -> None:
    """The NaN in dL/dy never reaches the weights below: their gradient is finite."""
    w = jnp.eye(4)
    x = jnp.ones((2, 8, 4))
    c = jnp.asarray(nonfinite_gradient())
    stats = clipjax.activation_stats_init(k=1)
    loss = lambda w, s: jnp.sum(clipjax.clip_activation_gradient(x @ w, s, k=1) * c)
    grad_w, stats_grad = jax.grad(loss, argnums=(0, 1))(w, stats)
    assert bool(jnp.all(jnp.isfinite(grad_w))) and bool(jnp.all(jnp.isfinite(stats_grad.values)))
    plain = jax.grad(lambda w: jnp.sum((x @ w) * c))(w)
    assert not bool(jnp.all(jnp.isfinite(plain)))  # without it the NaN spreads


def test_a_monitor_passes_a_non_finite_gradient_on_and_reports_finite_statistics() -> None:
    g = nonfinite_gradient()
    out, stats_grad = pull(g, 0, percentiles=(50,))
    np.testing.assert_array_equal(out, g)  # k=0 changes nothing, NaN included
    got = read(stats_grad)
    assert got["nonfinite_tokens"] == 3 and np.isfinite(got["p50"]) and np.isfinite(got["top_norm"])


def test_fewer_finite_tokens_than_k_zeroes_them_all_and_reads_missing_norms_as_zero() -> None:
    g = np.full((1, 4, 3), np.nan, np.float32)
    g[0, 0] = 1.0
    out, stats_grad = pull(g, 2, percentiles=(50,))
    assert not np.any(np.asarray(out))
    got = read(stats_grad)
    assert got["top_norm"] == pytest.approx(3**0.5) and got["top_norm_2"] == 0.0
    assert got["threshold"] == 0.0 and got["clipped_tokens"] == 1 and got["nonfinite_tokens"] == 3
    _, stats_grad = pull(np.full((1, 4, 3), np.inf, np.float32), 1, percentiles=(50,))
    assert read(stats_grad)["p50"] == 0.0  # no finite token: 0, not NaN


# --------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize("k", [6, 7])
def test_k_at_or_above_the_token_count_fails_when_traced_and_names_k(k: int) -> None:
    y = jnp.ones((2, 3, 4))  # 6 tokens
    stats = clipjax.activation_stats_init(k=k)
    with pytest.raises(ValueError, match=rf"k={k} must be less than the number of tokens, 6"):
        clipjax.clip_activation_gradient(y, stats, k=k)
    with pytest.raises(ValueError, match=rf"k={k}"):
        jax.jit(lambda y: clipjax.clip_activation_gradient(y, stats, k=k))(y)
    assert clipjax.clip_activation_gradient(y, clipjax.activation_stats_init(k=5), k=5) is y


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"k": -1}, "k must be an int >= 0"),
        ({"k": 2.0}, "k must be an int >= 0"),
        ({"mode": "scale"}, "mode must be one of"),
        ({"percentiles": (50, 101)}, r"percentiles must be in \[0, 100\]"),
        ({"percentiles": 50}, "percentiles must be None or a sequence"),
        ({"percentiles": (50, 50.0)}, "percentiles must be distinct"),
    ],
)
def test_bad_settings_fail_at_the_call(settings: dict, match: str) -> None:
    stats = clipjax.activation_stats_init()
    with pytest.raises(ValueError, match=match):
        clipjax.clip_activation_gradient(jnp.ones((4, 2)), stats, **settings)


def test_a_carrier_that_does_not_fit_fails_clearly() -> None:
    y = jnp.ones((2, 8, 4))
    with pytest.raises(TypeError, match=r"activation_stats_init\(k=4, percentiles=None\)"):
        clipjax.clip_activation_gradient(y, jnp.zeros(7))  # a bare array
    other = clipjax.activation_stats_init(k=2)
    with pytest.raises(ValueError, match=r"made by activation_stats_init\(k=2.*the call has k=4"):
        clipjax.clip_activation_gradient(y, other)
    stacked = clipjax.activation_stats_init(layers=3)
    with pytest.raises(ValueError, match=r"shape \(7,\).*got \(3, 7\).*lax.scan"):
        clipjax.clip_activation_gradient(y, stacked)
    wrong = clipjax.ActivationStats(jnp.zeros(5), clipjax.activation_stats_init().layout)
    with pytest.raises(ValueError, match=r"must have shape \(7,\).*got \(5,\)"):
        clipjax.clip_activation_gradient(y, wrong)
    with pytest.raises(ValueError, match="floating point"):
        clipjax.clip_activation_gradient(
            jnp.ones((8, 4), jnp.int32), clipjax.activation_stats_init()
        )


# --------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("mode", ["zero", "clip"])
def test_bfloat16_activations_have_float32_norms(mode: str) -> None:
    rng = np.random.default_rng(1)
    # 512 features of ~8: a bfloat16 sum of squares would be off by about a percent.
    g = jnp.asarray(rng.normal(size=(4, 16, 512)) * 8, jnp.bfloat16)
    out, stats_grad = pull(g, 3, mode, percentiles=(50,))
    assert out.dtype == jnp.bfloat16 and stats_grad.values.dtype == jnp.float32
    want_out, want = restated(np.asarray(g, np.float32), 3, mode, (50,))
    got = read(stats_grad)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
    if mode == "zero":
        np.testing.assert_array_equal(np.asarray(out, np.float32), want_out)
    else:  # the scaled tokens, rounded to bfloat16 once
        np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- reading


def test_activation_metrics_names_each_carrier_by_its_path_and_name() -> None:
    grads = {"block_0": pull(np.ones((2, 4)), 1)[1], "block_1": pull(np.ones((2, 4)), 0)[1]}
    m = clipjax.activation_metrics(grads)
    assert sorted(m) == [
        "activation_grad/block_0/clipped_tokens", "activation_grad/block_0/nonfinite_tokens",
        "activation_grad/block_0/threshold", "activation_grad/block_0/top_norm",
        "activation_grad/block_1/nonfinite_tokens", "activation_grad/block_1/top_norm",
    ]  # fmt: skip
    assert all(isinstance(v, np.ndarray) and v.shape == () for v in m.values())
    assert set(clipjax.activation_metrics(grads, name="mlp")) == {
        k.replace("activation_grad/", "activation_grad/mlp/") for k in m
    }
    assert set(clipjax.activation_metrics(grads["block_0"], name="out")) == {
        k.replace("block_0", "out") for k in m if "block_0" in k
    }
    with pytest.raises(ValueError, match=r"no clipjax\.ActivationStats"):
        clipjax.activation_metrics({"w": jnp.ones(3)})


def test_clipjax_metrics_reads_the_carriers_beside_an_optimizer_state() -> None:
    tx = optax.chain(clipjax.clip_by_global_norm(1.0), optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(3)})
    stats_grad = pull(np.ones((3, 4)), 1)[1]
    m = clipjax.metrics({"opt": state, "activation": {"mlp": stats_grad}})
    assert "clip_by_global_norm/global/grad_norm" in m
    assert float(m["activation_grad/activation/mlp/top_norm"]) == 2.0
    nested = clipjax.metrics({"mlp": stats_grad}, flat=False)
    assert float(nested["activation_grad"]["mlp"]["clipped_tokens"]) == 3.0  # a tie of three
    inside = jax.jit(lambda s: clipjax.metrics({"mlp": s}))(stats_grad)
    assert float(inside["activation_grad/mlp/top_norm"]) == 2.0


def test_clipjax_imports_without_flax_and_the_flax_factories_say_so() -> None:
    code = (
        "import sys; sys.modules['flax'] = None\n"  # `import flax` raises ImportError
        "import jax, jax.numpy as jnp, clipjax\n"
        "s = clipjax.activation_stats_init(k=1)\n"
        "g = jax.grad(lambda s: clipjax.clip_activation_gradient(jnp.ones((3, 2)), s, k=1)"
        ".sum() + 0.0 * s.values.sum())(s)\n"
        "try:\n    clipjax.linen_activation_clip()\nexcept ImportError:\n    print('no flax')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "no flax"


def test_tokens_with_a_zero_gradient_are_not_counted_as_clipped() -> None:
    """Two tokens carry a gradient (a loss on two positions): with k=4 the 4th largest norm
    is 0, every token is at or above it, and only the two that had a gradient count."""
    g = np.zeros((2, 8, 4), np.float32)
    g[0, 3], g[1, 7] = 1.0, 2.0
    out, stats_grad = pull(g, 4)
    assert not np.any(np.asarray(out))
    got = read(stats_grad)
    assert got["threshold"] == 0.0 and got["clipped_tokens"] == 2 and got["top_norm"] == 4.0


def test_float64_activations_keep_their_dtype_and_report_float32(x64: None) -> None:
    g = np.random.default_rng(2).normal(size=(3, 5, 4))
    out, stats_grad = pull(jnp.asarray(g, jnp.float64), 2, "clip", percentiles=(50,))
    assert out.dtype == jnp.float64 and stats_grad.values.dtype == jnp.float32
    want_out, want = restated(g, 2, "clip", (50,))
    np.testing.assert_allclose(out, want_out, rtol=1e-12)
    for name, value in read(stats_grad).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-7, err_msg=name)

"""Properties every adaptive clipper keeps on any norm sequence (hypothesis): scale in [0, 1];
clipped, the output norm is at most the threshold; else the output is the input; dtype kept."""

from __future__ import annotations

import functools
from functools import partial

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clipjax
from tests import drive

W3 = dict(warmup_steps=3, min_history=3)
CLIPPERS = {
    "autoclip": partial(clipjax.autoclip, **W3),
    "autoclip_window": partial(clipjax.autoclip, mode="percentile", window_size=5, **W3),
    "autoclip_ema": partial(clipjax.autoclip, mode="percentile", history="ema", **W3),
    "zscore_clip": partial(clipjax.zscore_clip, **W3),
    "zclip": partial(clipjax.zclip, warmup_steps=3, max_grad_norm=None),
    "zclip_capped": partial(clipjax.zclip, warmup_steps=3, max_grad_norm=2.0),
    "hist_clip": partial(clipjax.hist_clip, warmup_steps=3, warmup_clip=None),
    "hist_clip_ema": lambda: clipjax.hist_clip(
        clipjax.ema_criterion(clip_fn=clipjax.reciprocal_clipping), warmup_steps=3, warmup_clip=None
    ),
}
# Same shapes every example: one compiled scan per clipper for the whole search.
LENGTH = 24
norms_strategy = st.lists(
    st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False),
    min_size=LENGTH,
    max_size=LENGTH,
)


@functools.cache
def compiled(name: str):
    return drive.runner(CLIPPERS[name]())


@pytest.mark.parametrize("name", sorted(CLIPPERS))
@settings(max_examples=40)
@given(norms=norms_strategy)
def test_scale_threshold_identity(name: str, norms: list[float]) -> None:
    got = drive.run(None, np.asarray(norms), compiled=compiled(name))
    scale, applied = got["scale"], got["applied"]
    assert np.all((scale >= 0) & (scale <= 1))
    clipped = got["clipped"]
    out_norm = applied * np.asarray(norms, np.float32)
    assert np.all(out_norm[clipped] <= got["threshold"][clipped] * (1 + 1e-5))
    assert np.all(got["identical"][~clipped])
    np.testing.assert_array_equal(clipped, scale < 1)


@pytest.mark.parametrize("name", sorted(CLIPPERS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtype_preserved_and_unclipped_leaves_untouched(name: str, dtype) -> None:
    tx = CLIPPERS[name]()
    params = {"a": jnp.ones((3, 2), dtype), "b": jnp.full((5,), 2.0, dtype)}
    state = tx.init(params)
    out, state = tx.update(params, state, params)
    [clipped] = [v for k, v in clipjax.metrics(state).items() if k.endswith("/global/clipped")]
    for k in params:
        assert out[k].dtype == dtype
        if not bool(clipped):
            np.testing.assert_array_equal(
                np.asarray(out[k], np.float32), np.asarray(params[k], np.float32)
            )

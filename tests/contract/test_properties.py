"""Properties every adaptive clipper keeps on any norm sequence (hypothesis).

Scale in [0, 1]; when clipped the output norm is at most the threshold; when
not clipped the output equals the input exactly; dtype preserved.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clipjax
from tests import drive

CLIPPERS = {
    "autoclip": lambda: clipjax.autoclip(warmup_steps=3, min_history=3),
    "autoclip_window": lambda: clipjax.autoclip(
        mode="percentile", window_size=5, warmup_steps=3, min_history=3
    ),
    "autoclip_ema": lambda: clipjax.autoclip(
        mode="percentile", history="ema", warmup_steps=3, min_history=3
    ),
    "zscore_clip": lambda: clipjax.zscore_clip(warmup_steps=3, min_history=3),
    "zclip": lambda: clipjax.zclip(warmup_steps=3, max_grad_norm=None),
    "zclip_capped": lambda: clipjax.zclip(warmup_steps=3, max_grad_norm=2.0),
    "hist_clip": lambda: clipjax.hist_clip(warmup_steps=3, warmup_clip=None),
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


COMPILED: dict[str, object] = {}


def compiled(name: str):
    if name not in COMPILED:
        COMPILED[name] = drive.runner(CLIPPERS[name]())
    return COMPILED[name]


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
    for k in params:
        assert out[k].dtype == dtype
        if bool(
            clipjax.metrics(state)[
                f"{name.split('_capped')[0].split('_window')[0].split('_ema')[0]}/global/clipped"
            ]
        ):
            continue
        np.testing.assert_array_equal(
            np.asarray(out[k], np.float32), np.asarray(params[k], np.float32)
        )

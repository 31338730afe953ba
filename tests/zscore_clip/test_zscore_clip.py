"""zscore_clip against smartclip's ZScoreClip core."""

from __future__ import annotations

import numpy as np
import pytest

import clipjax
from tests import drive
from tests import references as R

STREAMS = {"spikes": lambda: R.spikes()[0], "regime_shift": R.regime_shift, "constant": R.constant}


@pytest.mark.skipif(not R.have_smartclip(), reason="smartclip not installed")
@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize("zmax, decay", [(3.0, 0.99), (2.0, 0.9)])
def test_matches_smartclip(stream: str, zmax: float, decay: float) -> None:
    norms = STREAMS[stream]()
    kw = dict(zmax=zmax, ema_decay=decay, warmup_steps=30, min_history=20)
    ref = R.smartclip_zscore(norms, **kw)
    got = drive.run(clipjax.zscore_clip(**kw), norms)
    fields = {"threshold": "threshold", "scale": "scale", "applied": "scale", "mean": "mean"}
    for field, want in fields.items():
        np.testing.assert_allclose(got[field], ref[want], rtol=3e-5, atol=1e-7, err_msg=field)
    np.testing.assert_allclose(got["std"], ref["std"], rtol=3e-5, atol=2e-6)


def test_stable_variance_in_float32() -> None:
    """SPEC 8.14: m2 - m**2 cancels in float32 for large norms; the recursion does not."""
    norms = 1e4 + np.random.default_rng(0).normal(0, 1.0, 500)
    got = drive.run(clipjax.zscore_clip(), norms)
    m = m2 = None
    for x in norms:  # float64 restatement of smartclip's EMA moments
        m = x if m is None else 0.99 * m + 0.01 * x
        m2 = x * x if m2 is None else 0.99 * m2 + 0.01 * x * x
    np.testing.assert_allclose(got["std"][-1], np.sqrt(m2 - m * m), rtol=1e-3)


def test_nan_is_kept_out() -> None:
    clean = R.spikes()[0]
    tx = clipjax.zscore_clip()
    got = drive.run(tx, R.with_nan(clean, at=70))
    skip = drive.run(tx, np.delete(clean, 70))
    np.testing.assert_allclose(got["threshold"][71:], skip["threshold"][70:], rtol=1e-6)


@pytest.mark.parametrize("kwargs", [{"zmax": 0.0}, {"ema_decay": 0.0}, {"min_history": -1}])
def test_invalid_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        clipjax.zscore_clip(**kwargs)

"""``skip_on_spike`` next to OLMo-core's ``SkipStepOptimizer`` and Levanter's skip-step
wrapper, restated: they agree until their windows hold a spike or a NaN loss (they keep it)."""

from __future__ import annotations

import numpy as np
import optax

import clipjax
from tests.skip_streams import STEPS, directions, make_stream, norm64, run


def levanter_thresholds(norms: list[float], length: int, sigma: float) -> list[tuple[bool, float]]:
    """Levanter's rule restated: a window of the last ``length + 1`` values, every
    value stored (skipped or not), population std floored at 1e-6, judged once it
    holds ``max(2, length // 2)`` values."""
    window: list[float] = []
    out = []
    for g in norms:
        if len(window) >= max(2, length // 2):
            mean = np.nanmean(window)
            threshold = mean + sigma * max(np.nanstd(window), 1e-6)
            skip = not g <= threshold
        else:
            threshold, skip = np.inf, False
        out.append((skip, threshold))
        window = [*window, g][-(length + 1) :]
    return out


def olmo_thresholds(values: list[float], length: int, sigma: float) -> list[tuple[bool, float]]:
    """OLMo-core's rule restated: the last ``length`` values before this one,
    every value stored, Bessel-corrected std, judged once ``max(20, length // 2)``
    values (this one included) were seen."""
    seen: list[float] = []
    out = []
    for x in values:
        seen = [*seen, x][-(length + 1) :]
        if len(seen) < max(20, length // 2):
            out.append((False, np.inf))
            continue
        history = seen[:-1]
        threshold = np.mean(history) + sigma * np.std(history, ddof=1)
        out.append((not (x - np.mean(history)) <= sigma * np.std(history, ddof=1), threshold))
    return out


def test_levanter_agrees_until_its_window_holds_a_spike() -> None:
    length, sigma = 16, 4.0
    grads, _ = make_stream("clean")
    norms = [norm64(g) for g in grads]
    norms[30], norms[32] = 10.0, 3.5  # a spike, then a smaller one
    grads = [{k: v * np.float32(n) for k, v in d.items()} for d, n in zip(directions(STEPS), norms)]
    lev = levanter_thresholds(norms, length, sigma)
    # Same window (length + 1 values), same gate, no loss.
    tx = clipjax.skip_on_spike(
        optax.sgd(1.0), window_size=length + 1, min_history=length // 2, sigma=sigma
    )
    states = [s for _, s in run(tx, grads, None)]
    for t in range(31):
        assert bool(states[t].metrics["skipped"][0]) == lev[t][0], t
        np.testing.assert_allclose(states[t].metrics["grad_threshold"][0], lev[t][1], rtol=1e-5)
    assert lev[30][0] and bool(states[30].metrics["skipped"][0])
    # Levanter stored the spike: its std, and so its threshold, jumped, and the
    # second spike goes through; here the window is clean and it is skipped.
    assert lev[32][1] > 2 * float(states[32].metrics["grad_threshold"][0])
    assert not lev[32][0] and bool(states[32].metrics["skipped"][0])


def test_olmo_core_agrees_until_its_window_holds_a_nan_loss() -> None:
    length, sigma = 40, 4.0
    grads, losses = make_stream("clean")
    losses[45] = 9.0
    olmo = olmo_thresholds(losses, length, sigma)
    # Same history (the last `length` values), same gate (>= 19 values before
    # this one); OLMo-core's std is Bessel-corrected, so its thresholds are a
    # little higher and the decisions agree away from the boundary.
    tx = clipjax.skip_on_spike(
        optax.sgd(1.0), window_size=length, min_history=max(20, length // 2) - 1, sigma=sigma
    )
    states = [s for _, s in run(tx, grads, losses)]
    for t in range(STEPS):
        assert bool(states[t].metrics["skipped"][0]) == olmo[t][0], t
        if t > 45:
            continue  # OLMo-core's window now holds the spike
        ours = float(states[t].metrics["value_threshold"][0])
        if np.isfinite(olmo[t][1]):
            assert ours <= olmo[t][1] and np.isclose(ours, olmo[t][1], rtol=2e-2)
        else:
            assert ours == np.inf
    # A NaN loss: OLMo-core stores it, its mean turns NaN, and it skips every
    # step until the NaN leaves the window. Here only the NaN step is skipped.
    losses[25] = np.nan
    olmo = olmo_thresholds(losses, length, sigma)
    states = [s for _, s in run(tx, grads, losses)]
    assert all(skip for skip, _ in olmo[25:STEPS])
    skipped = [t for t, s in enumerate(states) if bool(s.metrics["skipped"][0])]
    assert skipped == [25, 45]

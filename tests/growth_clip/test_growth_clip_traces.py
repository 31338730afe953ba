"""The rest of ``test_growth_clip.py``'s trace matrices: the other growth settings and
EMA settings against the restatements of torchzero's code."""

from __future__ import annotations

import pytest

from tests.growth_clip.test_growth_clip import (
    EMA_CASES,
    FAST_EMA,
    SETTINGS,
    check_ema,
    check_per_param,
    settings_id,
)

# Slow: six more traces, each compiled and restated (about 15 s on 2 cores); the fast
# suite keeps two growth settings and two EMA settings.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("settings", SETTINGS[2:], ids=settings_id)
def test_per_param_trace_equals_torchzero(settings: dict) -> None:
    check_per_param(settings)


@pytest.mark.parametrize(
    ("scope", "settings"), [c for c in EMA_CASES if c not in FAST_EMA], ids=str
)
def test_ema_trace_equals_torchzero(scope: str, settings: dict) -> None:
    check_ema(scope, settings)

"""The rest of ``test_skip_and_clip.py``'s trace matrix: every drop rule with and
without ``max_norm`` against the restatement of AXLearn's code."""

from __future__ import annotations

import pytest

from tests.skip_and_clip.test_skip_and_clip import FAST_TRACES, TRACE_CASES, check_trace

# Slow: seven more 400-step traces, each compiled and restated twice (about 20 s on 2
# cores); the fast suite keeps one trace of each kind of drop_norm.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("rule", "max_norm"), [c for c in TRACE_CASES if c not in FAST_TRACES])
def test_trace_equals_axlearn(rule: str, max_norm: float | None) -> None:
    check_trace(rule, max_norm)

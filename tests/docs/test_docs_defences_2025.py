"""docs/defences_2025.md: every code block runs and prints what the page implies."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from tests.paths import ROOT

PAGE = ROOT / "docs" / "defences_2025.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(PAGE), "exec"), {})
    return out.getvalue().strip()


def test_the_page_has_a_block_for_each_defence() -> None:
    names = ["skip_and_clip_by_global_norm", "clip_norm_growth", "clip_grad_adapt",
             "clip_by_historical_norm"]  # fmt: skip
    found = blocks()
    assert len(found) == 4
    assert all(any(n in b for b in found) for n in names)


def test_skip_and_clip_counts_each_threshold() -> None:
    printed = run(blocks()[0])
    assert printed == str([f"count_exceeds_{k}x_stddev" for k in (100, 20, 40)])


def test_growth_is_capped_at_one_and_a_half_times_the_last_norm() -> None:
    # The 3-vector of 1.2s has norm 1.2 * sqrt(3): the bound is 1.5 times it.
    assert float(run(blocks()[1])) == pytest.approx(1.8 * 3**0.5, rel=1e-5)


def test_adamwclip_clips_the_spiking_element() -> None:
    assert float(run(blocks()[2])) == 0.25  # one element of four


def test_the_levanter_chain_has_no_threshold_before_64_norms() -> None:
    assert run(blocks()[3]) == "inf"

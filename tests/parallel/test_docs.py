"""The ```python blocks of docs/data_parallel.md, docs/flax.md and README.md that import
clipjax and use ``jax.pmap``, sharded ``jit``, ``nnx.Optimizer`` or ``TrainState`` run on
8 devices."""

from __future__ import annotations

import os
import re

import jax
import pytest

from tests.paths import ROOT

SOURCES = [ROOT / "docs" / "data_parallel.md", ROOT / "docs" / "flax.md", ROOT / "README.md"]
TOPICS = ("jax.pmap", "NamedSharding", "nnx.Optimizer", "TrainState")


def example_blocks() -> list[str]:
    blocks: list[str] = []
    for source in SOURCES:
        if not source.exists():
            continue
        for block in re.findall(r"```python\n(.*?)```", source.read_text(), re.DOTALL):
            runnable = "import clipjax" in block and any(t in block for t in TOPICS)
            if runnable and block not in blocks:
                blocks.append(block)
    return blocks


BLOCKS = example_blocks()


def test_the_examples_are_found() -> None:
    text = "\n".join(BLOCKS)
    assert all(topic in text for topic in TOPICS), [b.splitlines()[:3] for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"example{i}" for i in range(len(BLOCKS))])
def test_example_runs(block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The examples set XLA_FLAGS for a fresh process; here JAX already has 8 devices.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    assert jax.device_count() == 8
    exec(compile(block, "<docs example>", "exec"), {"__name__": "__docs__"})

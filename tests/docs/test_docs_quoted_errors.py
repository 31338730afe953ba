"""The error messages the guides quote are the ones the code raises.

Each scenario below is one a page describes; the page's quoted message (in
``*"..."*``, line breaks as spaces) must be part of the message raised.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

import clipjax
from tests.paths import ROOT

flax_serialization = pytest.importorskip("flax.serialization")

TWO = {"l1": {"w": jnp.ones(2)}, "l2": {"w": jnp.ones(2)}}
THREE = {**TWO, "l3": {"w": jnp.ones(2)}}


def quotes(page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    return [" ".join(q.split()) for q in re.findall(r'\*"(.+?)"\*', text, re.S)]


def raised(action) -> str:
    with pytest.raises(Exception) as info:
        action()
    return " ".join(str(info.value).split())


def test_checkpointing_quotes_the_code() -> None:
    tx = clipjax.zclip(scope="per_layer")
    data = flax_serialization.to_bytes(tx.init(TWO))
    messages = [
        raised(lambda: flax_serialization.from_bytes(tx.init(THREE), data)),
        raised(lambda: tx.update(THREE, tx.init(TWO))),
    ]
    found = quotes("checkpointing.md")
    assert len(found) >= 2, found
    for quote in found:
        assert any(quote in m for m in messages), f"{quote!r} is not raised: {messages}"

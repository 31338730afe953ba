"""One metrics prefix per transform: two given the same ``name=`` raise, naming the prefix and
the fix; generated names (``algo``, ``algo_1``, ...) skip every name given with ``name=``."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

PARAMS = {"w": jnp.zeros(4), "b": jnp.zeros(2)}


def stepped(tx: Any, steps: int = 3) -> Any:
    state = tx.init(PARAMS)
    for t in range(steps):
        grads = {"w": jnp.full(4, 1.0 + t), "b": jnp.full(2, -2.0)}
        _, state = tx.update(grads, state, PARAMS)
    return state


def prefixes(metrics: dict[str, Any]) -> set[str]:
    return {key.split("/")[0] for key in metrics}


def test_two_transforms_with_one_name_raise() -> None:
    """The issue's example: the two ``c`` clippers' fields used to be mixed in one set."""
    tx = optax.chain(
        clipjax.zclip(name="c", warmup_steps=2), clipjax.clip_by_global_norm(0.5, name="c")
    )
    state = stepped(tx)
    with pytest.raises(ValueError, match=r"named 'c' \(a zclip and a clip_by_global_norm\).*name="):
        clipjax.metrics(state)
    # Each state alone still reads.
    assert clipjax.metrics(state[0])["c/global/grad_norm"] == pytest.approx(np.sqrt(8 + 4 * 9))


def test_a_generated_name_skips_the_names_given() -> None:
    """The issue's example: ``zclip(name="zclip_1")`` before two default zclips."""
    tx = optax.chain(clipjax.zclip(name="zclip_1"), clipjax.zclip(), clipjax.zclip())
    state = stepped(tx)
    m = clipjax.metrics(state)
    assert prefixes(m) == {"zclip_1", "zclip", "zclip_2"}
    # Tree order: the first default zclip is "zclip", the second "zclip_2".
    for prefix, member in (("zclip_1", 0), ("zclip", 1), ("zclip_2", 2)):
        alone = {k.split("/", 1)[1]: v for k, v in clipjax.metrics(state[member]).items()}
        mine = {k.split("/", 1)[1]: v for k, v in m.items() if k.split("/")[0] == prefix}
        assert mine.keys() == alone.keys()
        for field in mine:
            np.testing.assert_array_equal(mine[field], alone[field], err_msg=f"{prefix}/{field}")


def test_a_name_taken_by_another_kind_is_skipped() -> None:
    tx = optax.chain(clipjax.clip_by_global_norm(1.0, name="zclip"), clipjax.zclip())
    assert prefixes(clipjax.metrics(stepped(tx))) == {"zclip", "zclip_1"}


def test_default_names_stay_as_they_were() -> None:
    tx = optax.chain(clipjax.zclip(), clipjax.autoclip(), clipjax.zclip(), clipjax.zclip())
    assert prefixes(clipjax.metrics(stepped(tx))) == {"zclip", "zclip_1", "zclip_2", "autoclip"}


def test_a_wrapper_and_its_inner_transforms_share_one_scope() -> None:
    """skip_on_spike's inner states report beside it, so their names must differ from its."""
    inner = clipjax.chain(clipjax.zclip(name="guard"), clipjax.adamw(1e-3))
    tx = clipjax.skip_on_spike(inner, window_size=4, name="guard")
    with pytest.raises(ValueError, match=r"named 'guard'"):
        clipjax.metrics(stepped(tx))


def test_nested_transforms_have_a_scope_of_their_own() -> None:
    """hist_clip's warm-up clip reports under hist_clip's prefix: it may reuse an outer name."""
    warm = clipjax.clip_by_global_norm(1.0, name="c")
    tx = optax.chain(clipjax.hist_clip(warmup_steps=2, warmup_clip=warm), clipjax.zclip(name="c"))
    m = clipjax.metrics(stepped(tx))
    assert "hist_clip/c/global/grad_norm" in m and "c/global/grad_norm" in m


def test_the_same_named_transform_in_two_partitions_raises() -> None:
    clipper = clipjax.zclip(name="shared")
    tx = optax.partition({"w": clipper, "b": clipper}, {"w": "w", "b": "b"})
    with pytest.raises(ValueError, match="'shared'"):
        clipjax.metrics(stepped(tx))
    # Default names number the two copies instead.
    tx = optax.partition({"w": clipjax.zclip(), "b": clipjax.zclip()}, {"w": "w", "b": "b"})
    assert prefixes(clipjax.metrics(stepped(tx))) == {"zclip", "zclip_1"}

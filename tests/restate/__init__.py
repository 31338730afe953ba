"""Float64 NumPy restatements of clipjax's adaptive rules, one module per rule, written from
the rules as the docstrings and papers state them, not from clipjax's code (``from tests
import restate as S``, then ``S.zclip(...)``); :mod:`.run` runs clipjax on trees of given
group norms and compares.

A "clipper" function walks a 1-D sequence of norms (NaN/Inf allowed; :func:`adagc` takes
``[steps, groups]``) under a ``feedback`` (``"observe_first"``, ``"raw"``, ``"clipped"``,
``"clip_target"``, ``"skip"``) and returns, per step, what clipjax must report:
``COMMON`` (``grad_norm``, ``threshold`` (the spike boundary), ``scale``, ``clipped``,
``count``, ``step``, ``clipped_count``, ``nonfinite_count``) and the rule's statistics
after the step (zclip and hist_clip also ``clip_to``, the norm a step leaves with). A
value no rule defines is NaN here and not compared (:func:`compare`).
"""

from __future__ import annotations

from tests.restate._common import COMMON, INF, NAN, RTOL, Z_ATOL
from tests.restate.adagc import adagc
from tests.restate.autoclip import P2Median, autoclip, zscore_clip
from tests.restate.hist_clip import hist_clip
from tests.restate.p2 import P2, p2_restated
from tests.restate.run import (
    UNIT,
    check_run,
    compare,
    flat_tree,
    group_norms,
    layer_tree,
    run_tree,
    run_trees,
)
from tests.restate.skip_on_spike import skip_on_spike
from tests.restate.zclip import zclip

__all__ = [
    "COMMON", "INF", "NAN", "P2", "RTOL", "UNIT", "Z_ATOL", "P2Median", "adagc", "autoclip",
    "check_run", "compare", "flat_tree", "group_norms", "hist_clip", "layer_tree",
    "p2_restated", "run_tree", "run_trees", "skip_on_spike", "zclip", "zscore_clip",
]  # fmt: skip

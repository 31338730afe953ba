"""Float64 NumPy restatements of clipjax's adaptive rules: one module per rule.

:mod:`.autoclip` (autoclip and zscore_clip), :mod:`.zclip`, :mod:`.hist_clip`,
:mod:`.adagc`, :mod:`.skip_on_spike`, :mod:`.p2` (P², smartclip's and the
textbook's), :mod:`.spam` (spam and stable_spam, on gradients); :mod:`.run` runs
clipjax on trees of given group norms and compares. Each of these rules is restated
once, here (the one-line rules of agc, the element-wise clippers and the p-norms are
restated in their own test files): a test that needs one imports it (``from tests
import restate as S``, then ``S.zclip(...)``; the functions are re-exported under
the names of their modules).

Written from the rules as the docstrings and the papers state them, not from
clipjax's code: each function walks a sequence of group norms step by
step in float64 Python and returns what clipjax must report, per step:

``grad_norm``, ``threshold``, ``scale``, ``clipped``, ``count``, ``step``,
``clipped_count``, ``nonfinite_count`` and the algorithm's statistics
(after the step's update). A value no rule defines (a threshold before
any observation, a threshold on a non-finite step) is NaN here and is not
compared (see :func:`compare`).

Every "clipper" function takes a 1-D float sequence of norms (NaN/Inf allowed)
and a ``feedback`` in ``"observe_first"``, ``"raw"``, ``"clipped"``,
``"clip_target"`` (zclip, hist_clip), ``"skip"``. ``threshold`` is the spike
boundary on every step; zclip and hist_clip also give
``clip_to``, the norm a step leaves with.
:func:`adagc` takes ``[steps, groups]`` (its warm-up uses the global norm).
"""

from __future__ import annotations

from tests.restate._common import COMMON, INF, NAN, RTOL, Z_ATOL
from tests.restate.adagc import adagc
from tests.restate.autoclip import P2Median, autoclip, zscore_clip
from tests.restate.hist_clip import hist_clip
from tests.restate.p2 import P2, p2_restated
from tests.restate.run import UNIT, compare, flat_tree, group_norms, layer_tree, run_tree
from tests.restate.skip_on_spike import skip_on_spike
from tests.restate.zclip import zclip

__all__ = [
    "COMMON",
    "INF",
    "NAN",
    "P2",
    "RTOL",
    "UNIT",
    "Z_ATOL",
    "P2Median",
    "adagc",
    "autoclip",
    "compare",
    "flat_tree",
    "group_norms",
    "hist_clip",
    "layer_tree",
    "p2_restated",
    "run_tree",
    "skip_on_spike",
    "zclip",
    "zscore_clip",
]

"""The string choices of clipjax's public arguments, as ``Literal`` types.

A type checker then flags a misspelt choice (``scope="per-layer"``), and the
API reference lists the accepted strings in each signature. The same choices
are checked at construction, with a ``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Literal

# What a clipper's statistics learn from a step: the norm before judging it
# (observe_first), the raw norm, the norm capped at the spike boundary
# (clipped), or nothing on a spike (skip).
Feedback = Literal["observe_first", "raw", "clipped", "skip"]
# The same, for the clippers that always judge a step before observing it.
SpikeFeedback = Literal["raw", "clipped", "skip"]
# zclip and hist_clip also offer the value their rule clips to (clip_target).
TargetFeedback = Literal["raw", "clipped", "clip_target", "skip"]

AutoClipMode = Literal["auto", "percentile"]
AutoClipHistory = Literal["all", "window", "ema", "geometric"]
ZClipMode = Literal["zscore", "percentile"]
ClipOption = Literal["adaptive_scaling", "mean"]
PercentileMethod = Literal["auto", "exact", "approx"]

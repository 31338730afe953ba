"""clipjax: adaptive gradient clipping for JAX, as optax transforms.

Every clipper is an ``optax.GradientTransformation`` whose state is a
jit-compatible pytree carrying its per-step metrics; read them with
:func:`clipjax.metrics`.
"""

from clipjax import _serialization
from clipjax._adagc import AdaGCState, adagc
from clipjax._agc import AGCState, agc
from clipjax._autoclip import AutoClipState, autoclip
from clipjax._elementwise import (
    ClipByPercentileState,
    ClipByValueState,
    clip_by_percentile,
    clip_by_value,
)
from clipjax._fold import SkippableTransform, UpdateClippingState, adam, adamw, chain
from clipjax._grouping import path_name, stacked
from clipjax._hist_clip import (
    Criterion,
    HistClipState,
    ema_criterion,
    hist_clip,
    max_clipping,
    mean_clipping,
    reciprocal_clipping,
    zstat_criterion,
)
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo, metrics
from clipjax._percentile import approx_percentile, approx_relative_error, exact_percentile
from clipjax._skip import (
    ConditionalRouteWarning,
    SkipOnSpikeState,
    SkipOnSpikeTransform,
    skip_on_spike,
)
from clipjax._spam import SpamState, spam
from clipjax._stable_spam import AdaClipState, AdaNormState, ada_norm, adaclip, stable_spam
from clipjax._static import (
    ClipByGlobalNormState,
    NormalizePerParamState,
    ZScoreNormalizeState,
    clip_by_global_norm,
    global_norm,
    normalize_per_param,
    zscore_normalize,
)
from clipjax._zclip import ZClipState, zclip
from clipjax._zscore_clip import ZScoreClipState, zscore_clip

# With flax installed, its serialization knows clipjax's states from here on.
_serialization.register()

__version__ = "0.3.0"

__all__ = [
    "AGCState",
    "AdaClipState",
    "AdaGCState",
    "AdaNormState",
    "AutoClipState",
    "ClipByGlobalNormState",
    "ClipByPercentileState",
    "ClipByValueState",
    "ClipTransform",
    "ConditionalRouteWarning",
    "Criterion",
    "GroupInfo",
    "HistClipState",
    "NormalizePerParamState",
    "SkipOnSpikeState",
    "SkipOnSpikeTransform",
    "SkippableTransform",
    "SpamState",
    "UpdateClippingState",
    "ZClipState",
    "ZScoreClipState",
    "ZScoreNormalizeState",
    "ada_norm",
    "adaclip",
    "adagc",
    "adam",
    "adamw",
    "agc",
    "approx_percentile",
    "approx_relative_error",
    "autoclip",
    "chain",
    "clip_by_global_norm",
    "clip_by_percentile",
    "clip_by_value",
    "ema_criterion",
    "exact_percentile",
    "global_norm",
    "hist_clip",
    "max_clipping",
    "mean_clipping",
    "metrics",
    "normalize_per_param",
    "path_name",
    "reciprocal_clipping",
    "skip_on_spike",
    "spam",
    "stable_spam",
    "stacked",
    "zclip",
    "zscore_clip",
    "zscore_normalize",
    "zstat_criterion",
]

"""clipjax: adaptive gradient clipping for JAX, as optax transforms.

Every clipper is an ``optax.GradientTransformation`` whose state is a
jit-compatible pytree carrying its per-step metrics; read them with
:func:`clipjax.metrics`.
"""

from clipjax import _serialization
from clipjax._activation import (
    ActivationStats,
    activation_metrics,
    activation_stats_init,
    clip_activation_gradient,
    linen_activation_clip,
    nnx_activation_clip,
)
from clipjax._adaclip import AdaClipState, AdaNormState, ada_norm, adaclip
from clipjax._adagc import AdaGCState, adagc
from clipjax._adam import AdamWClipState, UpdateClippingState, adam, adamw
from clipjax._agc import AGCState, agc
from clipjax._attention_logits import max_attention_logits
from clipjax._autoclip import AutoClipState, autoclip
from clipjax._conditional import SkippableTransform, chain
from clipjax._elementwise import (
    ClipByPercentileState,
    ClipByValueState,
    clip_by_percentile,
    clip_by_value,
)
from clipjax._global_norm import (
    ClipByGlobalNormState,
    NormalizePerParamState,
    ZScoreNormalizeState,
    clip_by_global_norm,
    global_norm,
    normalize_per_param,
    zscore_normalize,
)
from clipjax._grouping import path_name, stacked
from clipjax._growth_clip import (
    ClipNormByEMAState,
    ClipNormGrowthState,
    clip_norm_by_ema,
    clip_norm_growth,
)
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
from clipjax._levanter_clip import HistoricalNormClipState, clip_by_historical_norm
from clipjax._metrics import GroupInfo, metrics
from clipjax._percentile import approx_percentile, approx_relative_error, exact_percentile
from clipjax._qk_clip import QKClipState, QKHeads, qk_clip
from clipjax._skip_and_clip import (
    SkipAndClipState,
    drop_norm_by_grad_norm_ema,
    drop_norm_by_grad_norm_stddev,
    skip_and_clip_by_global_norm,
)
from clipjax._skip_on_spike import (
    ConditionalRouteWarning,
    SkipOnSpikeState,
    SkipOnSpikeTransform,
    skip_on_spike,
)
from clipjax._spam import SpamState, spam, stable_spam
from clipjax._spectra import SpectraState, spectra
from clipjax._spectral_clip import SpectralClipState, spectral_clip
from clipjax._stability import StabilityMonitorState, stability_monitor
from clipjax._zclip import ZClipState, zclip
from clipjax._zscore_clip import ZScoreClipState, zscore_clip

# With flax installed, its serialization knows clipjax's states from here on.
_serialization.register()

__version__ = "0.4.0"

__all__ = [
    "AGCState",
    "ActivationStats",
    "AdaClipState",
    "AdaGCState",
    "AdaNormState",
    "AdamWClipState",
    "AutoClipState",
    "ClipByGlobalNormState",
    "ClipByPercentileState",
    "ClipByValueState",
    "ClipNormByEMAState",
    "ClipNormGrowthState",
    "ClipTransform",
    "ConditionalRouteWarning",
    "Criterion",
    "GroupInfo",
    "HistClipState",
    "HistoricalNormClipState",
    "NormalizePerParamState",
    "QKClipState",
    "QKHeads",
    "SkipAndClipState",
    "SkipOnSpikeState",
    "SkipOnSpikeTransform",
    "SkippableTransform",
    "SpamState",
    "SpectraState",
    "SpectralClipState",
    "StabilityMonitorState",
    "UpdateClippingState",
    "ZClipState",
    "ZScoreClipState",
    "ZScoreNormalizeState",
    "activation_metrics",
    "activation_stats_init",
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
    "clip_activation_gradient",
    "clip_by_global_norm",
    "clip_by_historical_norm",
    "clip_by_percentile",
    "clip_by_value",
    "clip_norm_by_ema",
    "clip_norm_growth",
    "drop_norm_by_grad_norm_ema",
    "drop_norm_by_grad_norm_stddev",
    "ema_criterion",
    "exact_percentile",
    "global_norm",
    "hist_clip",
    "linen_activation_clip",
    "max_attention_logits",
    "max_clipping",
    "mean_clipping",
    "metrics",
    "nnx_activation_clip",
    "normalize_per_param",
    "path_name",
    "qk_clip",
    "reciprocal_clipping",
    "skip_and_clip_by_global_norm",
    "skip_on_spike",
    "spam",
    "spectra",
    "spectral_clip",
    "stability_monitor",
    "stable_spam",
    "stacked",
    "zclip",
    "zscore_clip",
    "zscore_normalize",
    "zstat_criterion",
]

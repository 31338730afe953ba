"""clipjax: adaptive gradient clipping for JAX, as optax transforms.

Every clipper is an ``optax.GradientTransformation`` whose state is a
jit-compatible pytree carrying its per-step metrics; read them with
:func:`clipjax.metrics`.
"""

from clipjax._grouping import path_name
from clipjax._metrics import GroupInfo, metrics
from clipjax._static import ClipByGlobalNormState, clip_by_global_norm, global_norm

__version__ = "0.1.0"

__all__ = [
    "ClipByGlobalNormState",
    "GroupInfo",
    "clip_by_global_norm",
    "global_norm",
    "metrics",
    "path_name",
]

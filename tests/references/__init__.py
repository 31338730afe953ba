"""The reference packages themselves, driven on a sequence of norms.

One module per reference: :mod:`.smartclip`, :mod:`.zclip`, :mod:`.drytorch`,
:mod:`.spam` (pytorch-optimizer's SPAM and StableSPAM, on gradients); the norm
sequences in :mod:`.norms`. This package re-exports the norm-sequence drivers
and generators: ``from tests import references as R``, then ``R.spikes()``,
``R.zclip_reference(...)``.

Differential tests compare clipjax step by step against what the reference
implementations do when fed the same sequence of gradient norms:

* :func:`smartclip_autoclip`, :func:`smartclip_zscore` -- smartclip's pure
  Python core objects (``smartclip.AutoClip`` / ``smartclip.ZScoreClip``),
  driven exactly as smartclip's JAX backend drives them for ``scope="global"``
  (``smartclip/backends/jax/__init__.py``, ``apply_grads``). No torch needed.
* :func:`zclip_reference` -- ``zclip.ZClip`` on a one-parameter torch module.
* :func:`drytorch_reference` -- ``drytorch.lib.gradient_ops.HistClipper`` /
  ``ParamHistClipper`` on one or several torch parameters.

Every driver takes a 1-D array of norms (``drytorch_reference`` also a 2-D
``[steps, params]`` array) that may contain NaN/Inf, and returns a ``dict`` of
numpy arrays whose first axis is the step. The fields every driver returns:

``grad_norm`` (float64)
    The norm the reference itself saw that step, before clipping (for torch
    references: the value its own norm computation produced; equal to the input
    up to a few ulp of the parameter dtype).
``threshold`` (float64)
    The threshold / clip value of that step; defined per driver below. NaN
    where the reference has none.
``scale`` (float64)
    The multiplier applied to the gradient that step. smartclip: the value of
    the backend's formula. torch references: *measured*,
    ``||g_after||_2 / ||g_before||_2`` computed in float64 from the gradient
    tensors (1.0 when ``||g_before|| == 0``). When the input norm is non-finite
    the multiplier is unobservable from the tensors; then ``scale`` is 1.0 when
    the gradient came out unchanged (elementwise, NaN equal to NaN) and NaN
    otherwise, and ``finite_out`` says whether the output gradient is finite.
``clipped`` (bool)
    ``scale < 1`` (False for NaN scale).

Statistics fields (``mean``, ``std``, ``var``, ``median``, ``quantile``) are
read from the reference objects' attributes *after* the step (post-update), as
clipjax reports them; NaN where the reference holds none (``None``).

``torch`` (and the torch-based references) are imported lazily, inside the
drivers, so ``from tests import references`` works without torch; use
:func:`have_torch` etc. to decide whether to skip.

Norm-sequence generators (:mod:`.norms`): :func:`spikes`, :func:`regime_shift`,
:func:`constant`, :func:`with_nan`. All return float64 numpy arrays. P², restated
in float64, is :mod:`tests.restate.p2`.
"""

from __future__ import annotations

from tests.references._common import have_drytorch, have_smartclip, have_torch, have_zclip
from tests.references.drytorch import drytorch_reference
from tests.references.norms import SPIKE_FACTORS, constant, regime_shift, spikes, with_nan
from tests.references.smartclip import smartclip_autoclip, smartclip_zscore
from tests.references.zclip import zclip_reference

__all__ = [
    "SPIKE_FACTORS",
    "constant",
    "drytorch_reference",
    "have_drytorch",
    "have_smartclip",
    "have_torch",
    "have_zclip",
    "regime_shift",
    "smartclip_autoclip",
    "smartclip_zscore",
    "spikes",
    "with_nan",
    "zclip_reference",
]

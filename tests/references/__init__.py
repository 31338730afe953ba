"""The reference packages themselves, driven on given norms or gradients (``from tests
import references as R``; torch and the packages are imported inside the drivers).

:mod:`.smartclip` (its pure-Python cores, driven as its JAX backend drives them at
``scope="global"``; no torch), :mod:`.zclip` (``zclip.ZClip`` on a one-parameter torch
module), :mod:`.drytorch` (``HistClipper`` / ``ParamHistClipper``), :mod:`.spam` and
:mod:`.adamwclip` (optimizers on gradients); the norm sequences in :mod:`.norms`.

A norm driver takes norms (NaN/Inf allowed) and returns numpy arrays, first axis the
step: ``grad_norm`` (the norm the reference saw), ``threshold`` (per driver; NaN where
none), ``scale`` (smartclip: its backend's formula; torch: measured, ``||g_after|| /
||g_before||`` in float64, 1.0 for a zero gradient; on a non-finite norm 1.0 if the
gradient came out unchanged, else NaN, with ``finite_out``), ``clipped`` (``scale <
1``), and the statistics read from the reference after the step (NaN where it holds none).
"""

from __future__ import annotations

from tests.references._common import have_drytorch, have_smartclip, have_torch, have_zclip
from tests.references.drytorch import drytorch_reference
from tests.references.norms import SPIKE_FACTORS, constant, regime_shift, spikes, with_nan
from tests.references.smartclip import smartclip_autoclip, smartclip_zscore
from tests.references.zclip import zclip_reference

__all__ = [
    "SPIKE_FACTORS", "constant", "drytorch_reference", "have_drytorch", "have_smartclip",
    "have_torch", "have_zclip", "regime_shift", "smartclip_autoclip", "smartclip_zscore",
    "spikes", "with_nan", "zclip_reference",
]  # fmt: skip

"""torchzero's growth-capped clips: ``clip_norm_growth`` and ``clip_norm_by_ema``."""

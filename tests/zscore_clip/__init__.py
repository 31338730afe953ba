"""zscore_clip against smartclip's ZScoreClip core."""

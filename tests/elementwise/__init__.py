"""clip_by_value, clip_by_percentile and the per-leaf normalisers."""

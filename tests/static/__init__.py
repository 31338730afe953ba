"""clip_by_global_norm and the static clippers against optax and float64 NumPy."""

"""agc against optax.adaptive_grad_clip and smartclip's AGC."""

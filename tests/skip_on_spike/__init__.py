"""skip_on_spike, its training steps and dtypes, and the fold (clipjax.adam, adamw, chain)."""

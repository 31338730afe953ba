"""AXLearn's skip-and-clip: ``skip_and_clip_by_global_norm`` and its drop rules."""

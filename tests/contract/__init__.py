"""Every public transform: one contract, bad input, checkpoints, optax and flax
wrappers, metrics, grouping."""

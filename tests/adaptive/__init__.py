"""Adaptive clippers following a run: float64 restatements step by step, streaming
statistics, recorded runs."""

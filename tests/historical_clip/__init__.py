"""Levanter's historical update-norm clip: ``clip_by_historical_norm``."""

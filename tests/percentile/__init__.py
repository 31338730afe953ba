"""Percentiles of |x|: the sort and the radix select."""

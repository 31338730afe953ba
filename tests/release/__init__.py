"""What ships: examples, notebooks, benchmarks, wheel, version, and the suite's slow marks."""

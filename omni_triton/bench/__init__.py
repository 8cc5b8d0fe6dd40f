"""Benchmarks of the served pipeline against its baselines (benchmarks/README.md defines the metrics)."""

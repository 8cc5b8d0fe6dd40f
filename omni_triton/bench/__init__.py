"""Benchmarks of the served pipeline against its baselines (DESIGN.md section 6 names the metrics)."""

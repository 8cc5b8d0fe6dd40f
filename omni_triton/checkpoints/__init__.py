"""Checkpoints built on the spot: the tiny random-weight one the tests and `omni-triton serve` default to
(tiny.py), a dummy one from a model config for seeded random weights at full size (dummy.py), and their
tokenizer (tokenizer.py)."""

"""Benchmark the served pipeline against its baselines: see `python client/bench.py --help`."""

import sys

from omni_triton.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())

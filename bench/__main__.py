"""Placeholder until the benchmark lands; `make bench` runs this."""

import sys

sys.exit("bench: not yet implemented")

"""`python -m server [flags]`: `radix-mlx serve [flags]`, through the same code path."""

import sys

from server.launch.cli import run

run(["serve", *sys.argv[1:]])

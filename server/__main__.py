"""`python -m server [flags]`: the same as `radix-mlx serve [flags]`."""

import argparse
import sys

from server.config import add_serve_arguments
from server.serve import serve_command

parser = argparse.ArgumentParser(prog="python -m server", description="Run the HTTP server.")
add_serve_arguments(parser)
sys.exit(serve_command(parser.parse_args()))

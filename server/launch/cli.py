"""The `radix-mlx` command line."""

import argparse
import os
import sys
from typing import get_args

from engine.demo_model import FAMILIES, SIZES, build_demo_model
from engine.demo_vlm import VISION, build_demo_vlm

# The demo vision models (engine/demo_vlm.py): CLI name -> family.
VISION_FAMILIES = {"gemma3-vision": "gemma3", "qwen2.5-vl": "qwen2_5_vl",
                   "qwen2-vl": "qwen2_vl"}
from engine.platform_info import cpu_reexec_env, describe_platform
from server.config import Settings, add_serve_arguments
from server.launch.replicas import add_replicas_arguments, replicas_command


def main() -> None:
    """The `radix-mlx` console script and `python -m server.launch.cli`."""
    run(sys.argv[1:])


def run(argv: list[str]) -> None:
    """Run the command `argv` names, and exit with its status: the one way every entry
    point (`radix-mlx`, `python -m server`) starts, MLX's CPU environment included."""
    _reexec_for_cpu()
    args = build_parser().parse_args(argv)
    sys.exit(args.handler(args))


def _reexec_for_cpu() -> None:
    # LD_PRELOAD and the others only take effect at process start: run this same command
    # line again.
    env = cpu_reexec_env()
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radix-mlx",
        description="OpenAI-compatible MLX inference server with radix prefix caching.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP server")
    add_serve_arguments(serve)
    serve.set_defaults(handler=serve_command)

    replicas = commands.add_parser(
        "replicas",
        help="run N servers behind SGLang's cache-aware router (the `replicas` extra)",
    )
    add_replicas_arguments(replicas)
    replicas.set_defaults(handler=replicas_command)

    demo = commands.add_parser(
        "make-demo-model",
        help="write a random-weight model with a real tokenizer (no download)",
    )
    demo.add_argument("directory", help="where to write the model (replaced if it exists)")
    demo.add_argument("--size", choices=sorted({*SIZES, *VISION}), default="tiny",
                      help="4b: Gemma 3 4B's shape in bfloat16 (gemma3-vision only)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--family", choices=[*FAMILIES, *VISION_FAMILIES], default="llama",
                      help="gemma3-vision, qwen2.5-vl, qwen2-vl: Gemma 3, Qwen2.5-VL or "
                      "Qwen2-VL with a vision tower, from mlx-vlm's classes (the vision extra)")
    demo.set_defaults(handler=make_demo_model_command)

    convert = commands.add_parser(
        "convert", help="write the mlx-lm model directory of a GGUF file"
    )
    convert.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    convert.add_argument("directory", metavar="OUT_DIR", help="written (replaced if it exists)")
    convert.add_argument(
        "--dtype", default="auto", choices=get_args(Settings.model_fields["gguf_dtype"].annotation),
        help=Settings.model_fields["gguf_dtype"].description + " (default: auto)",
    )
    convert.set_defaults(handler=convert_command)

    info = commands.add_parser("info", help="print the device and BLAS that MLX uses here")
    info.set_defaults(handler=info_command)
    return parser


def serve_command(args: argparse.Namespace) -> int:
    from server.launch.serve import serve_command as serve  # imports MLX, so only when serving

    return serve(args)


def make_demo_model_command(args: argparse.Namespace) -> int:
    try:
        if args.family in VISION_FAMILIES:
            path = build_demo_vlm(args.directory, size=args.size, seed=args.seed,
                                  family=VISION_FAMILIES[args.family])
        else:
            path = build_demo_model(args.directory, size=args.size, seed=args.seed,
                                    family=args.family)
    except ValueError as error:  # a size the family lacks
        print(f"radix-mlx make-demo-model: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


def convert_command(args: argparse.Namespace) -> int:
    from engine.gguf import GGUFError, convert  # imports MLX, so only when converting

    try:
        print(convert(args.gguf, args.directory, args.dtype))
    except GGUFError as error:
        print(f"radix-mlx convert: {error}", file=sys.stderr)
        return 1
    return 0


def info_command(args: argparse.Namespace) -> int:
    print(describe_platform())
    return 0


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The wheels `bash bench/gpu.sh --vision` needs on the GPU machine beyond what it has, for
# radix-mlx's image path (engine/vision.py imports mlx_vlm) and for `python -m
# mlx_vlm.server`: mlx-vlm 0.7.10 and what those two import, for CPython 3.12 on x86-64
# Linux. Run here, from the repository root; they go to .dev/vlm/ (~31 MB):
#   bash bench/stage_vision_wheels.sh
# and are installed there over this project's own wheels (MLX, mlx-lm, fastapi, ...):
#   pip install --no-index --no-deps --upgrade --target /tmp/site .dev/vlm/*.whl
# PYTHONPATH=/tmp/site puts them ahead of the machine's own packages (numpy, torch,
# transformers, tokenizers, jinja2, httpx, pyyaml, protobuf, sentencepiece).
#
# Found by importing both paths and running `python -m bench.vision --size tiny` in a bare
# Python 3.12 with only those (transformers 4.57, 5.0 or none) and this project's wheels:
# - mlx-vlm; mlx-audio (mlx_vlm.server imports its audio_io when it starts: numpy only);
#   cryptography and cffi (the server's compaction imports Fernet); requests, urllib3 and
#   charset-normalizer (mlx_vlm.utils imports requests).
# - transformers 5, which mlx-vlm (>= 5.14) and mlx-lm (>= 5.7) declare, whatever the
#   machine has, and what transformers checks the version of when imported: tokenizers,
#   safetensors, huggingface-hub (1.x, on httpx; 2.x would bring httpx2, httpcore2 and
#   truststore), regex, tqdm, packaging.
# mlx-vlm's other declared dependencies are not imported on these paths and stay out:
# datasets, opencv-python, miniaudio, websockets, python-multipart, llguidance (this
# project's own), and hf-xet and typer beside huggingface-hub and transformers.
set -euo pipefail
wheels=(
  mlx-vlm==0.7.10 mlx-audio==0.6.2 cryptography==50.0.2 cffi==2.0.0 requests==2.34.2
  urllib3==2.8.0 charset-normalizer==3.5.3 transformers==5.24.0 tokenizers==0.23.3
  safetensors==0.8.0 huggingface-hub==1.33.0 regex==2026.11.19 tqdm==4.70.1 packaging==26.4
)
# Every manylinux tag a glibc 2.35 machine takes (MLX's CUDA wheels need that one).
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_17 \
  manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
rm -rf .dev/vlm
mkdir -p .dev/vlm
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  "${platforms[@]}" --dest .dev/vlm "${wheels[@]}"
ls -l .dev/vlm | awk 'NR > 1 {printf "%9.2f MB  %s\n", $5 / 1e6, $9}'
du -cb .dev/vlm/*.whl | awk 'END {printf "%9.2f MB  total, %d wheels\n", $1 / 1e6, NR - 1}'

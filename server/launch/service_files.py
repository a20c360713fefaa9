"""Render the launchd plist and the systemd unit from the templates in deploy/.

Both run `radix-mlx serve --config FILE` with absolute paths, and both give the server
drain_timeout (read from FILE) plus a margin between SIGTERM and SIGKILL, so a stop or
restart lets running requests finish. Used by deploy/*/radix-mlx-service and the tests.
"""

import argparse
import math
import os
import plistlib
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from server.config import Settings, load_settings

LABEL = "dev.radix-mlx.server"
EXIT_MARGIN_S = 5  # after the drain: uvicorn's shutdown, freeing the model, exit
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
PLACEHOLDER = re.compile(r"@[A-Z_]+@")
SYSTEMD_UNSAFE = re.compile(r'["\\%$\x00-\x1f]')  # quoting, specifiers, expansion


def service_settings(config_path: Path) -> Settings:
    """What the service will run with: its file alone, not the installer's environment."""
    return load_settings(argparse.Namespace(config_file=str(config_path)), environ={})


def stop_timeout(config_path: Path) -> int:
    """Seconds from SIGTERM to SIGKILL for the server that reads `config_path`."""
    return math.ceil(service_settings(config_path).drain_timeout) + EXIT_MARGIN_S


def health_url(config_path: Path) -> str:
    """Where `radix-mlx-service status` probes the server: a wildcard bind answers locally."""
    settings = service_settings(config_path)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
    return f"{settings.scheme}://{f'[{host}]' if ':' in host else host}:{settings.port}/health"


def render_launchd(
    template: Path,
    *,
    executable: Path,
    config_path: Path,
    log_dir: Path,
    label: str = LABEL,
    hf_home: Path | None = None,
    user_name: str | None = None,
) -> str:
    """The plist for ~/Library/LaunchAgents, or with `user_name` for /Library/LaunchDaemons."""
    values = _paths(executable, config_path, hf_home, user_name)
    values |= {"@LABEL@": label, "@LOG_DIR@": str(_absolute(log_dir))}
    plist = _fill_plist(plistlib.loads(template.read_bytes()), values)
    plist["ExitTimeOut"] = stop_timeout(config_path)
    if user_name:
        plist["UserName"] = user_name
    return plistlib.dumps(plist, sort_keys=False).decode()


def render_systemd(
    template: Path,
    *,
    executable: Path,
    config_path: Path,
    hf_home: Path | None = None,
    user_name: str | None = None,
) -> str:
    """A user unit, or with `user_name` a system unit running as that user."""
    values = _paths(executable, config_path, hf_home, user_name)
    values["@CACHE_DIR@"] = values["@HOME@"] + "/.cache"
    for value in values.values():
        if SYSTEMD_UNSAFE.search(value):
            raise ValueError(f"path {value!r} has a character systemd would reinterpret")
    values |= {
        "@STOP_TIMEOUT@": str(stop_timeout(config_path)),
        "@ACCOUNT@": f"User={user_name}" if user_name else "",
        "@TARGET@": "multi-user.target" if user_name else "default.target",
    }
    return _fill(template.read_text(), values)


def _paths(
    executable: Path, config_path: Path, hf_home: Path | None, user_name: str | None
) -> dict[str, str]:
    """Placeholders both managers share; the home is the service user's, not the caller's."""
    try:
        home = Path(f"~{user_name or ''}").expanduser()
    except RuntimeError:
        raise ValueError(f"unknown user {user_name!r}") from None
    executable, config_path = _absolute(executable), _absolute(config_path)
    return {
        "@EXECUTABLE@": str(executable),
        "@CONFIG@": str(config_path),
        "@WORKDIR@": str(config_path.parent),
        "@HOME@": str(home),
        "@HF_HOME@": str(_absolute(hf_home) if hf_home else home / ".cache" / "huggingface"),
        "@PATH@": f"{executable.parent}:{SYSTEM_PATH}",
    }


def _absolute(path: Path) -> Path:
    # absolute(), not resolve(): a venv's bin/ may be reached through a symlink on purpose.
    return Path(path).expanduser().absolute()


def _fill(text: str, values: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group() not in values:
            raise ValueError(f"template has an unknown placeholder {match.group()}")
        return values[match.group()]

    return PLACEHOLDER.sub(replace, text)


def _fill_plist(node: Any, values: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        return {key: _fill_plist(value, values) for key, value in node.items()}
    if isinstance(node, list):
        return [_fill_plist(value, values) for value in node]
    return _fill(node, values) if isinstance(node, str) else node


def main(argv: list[str] | None = None) -> int:
    """`python -m server.launch.service_files launchd|systemd|health-url ...`: print the result."""
    parser = argparse.ArgumentParser(prog="python -m server.launch.service_files")
    kinds = parser.add_subparsers(dest="kind", required=True)
    for kind in ("launchd", "systemd"):
        render = kinds.add_parser(kind, help=f"print the {kind} service file")
        render.add_argument("--template", type=Path, required=True)
        render.add_argument("--executable", type=Path, required=True, help="the radix-mlx script")
        render.add_argument("--config", type=Path, required=True, dest="config_path")
        render.add_argument("--hf-home", type=Path, default=os.environ.get("HF_HOME") or None)
        render.add_argument("--user-name", help="a LaunchDaemon / system unit for this user")
    kinds.choices["launchd"].add_argument("--log-dir", type=Path)
    kinds.choices["launchd"].add_argument("--label", default=LABEL)
    kinds.add_parser("health-url").add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.kind == "health-url":
            text = health_url(args.config) + "\n"
        else:
            keys = ("executable", "config_path", "hf_home", "user_name")
            common = {key: getattr(args, key) for key in keys}
            if args.kind == "launchd":
                log_dir = args.log_dir or Path(f"~{args.user_name or ''}/Library/Logs/radix-mlx")
                text = render_launchd(args.template, log_dir=log_dir, label=args.label, **common)
            else:
                text = render_systemd(args.template, **common)
    except ValueError as exc:  # ConfigError included: a bad config file stops the install
        print(f"radix-mlx-service: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

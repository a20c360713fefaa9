"""The launchd plist and systemd unit render from a config into valid, consistent files,
and the install scripts drive launchctl / systemctl as documented (stubbed here)."""

import argparse
import configparser
import getpass
import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from server.config import ConfigError, ModelSpec, Settings, add_serve_arguments, load_settings
from server.launch.service_files import health_url, render_launchd, render_systemd

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PLIST_TEMPLATE = DEPLOY / "launchd" / "dev.radix-mlx.server.plist"
UNIT_TEMPLATE = DEPLOY / "systemd" / "radix-mlx.service"
LEFTOVER = re.compile(r"@[A-Z_]+@")


@pytest.fixture
def install(tmp_path: Path) -> dict[str, Path]:
    """A fake venv with a radix-mlx script and a config file, both under paths with spaces."""
    bin_dir = tmp_path / "my venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "radix-mlx"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    python = bin_dir / "python"  # a symlink would lose the test venv's site-packages
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    config = tmp_path / "app support" / "config.toml"
    config.parent.mkdir()
    config.write_text('drain_timeout = 7.5\nport = 8123\nhost = "0.0.0.0"\n')
    return {"exe": exe, "config": config, "logs": tmp_path / "Logs" / "radix-mlx"}


def launchd(install: dict[str, Path], **extra: object) -> dict:
    text = render_launchd(
        PLIST_TEMPLATE,
        executable=install["exe"],
        config_path=install["config"],
        log_dir=install["logs"],
        **extra,
    )
    assert not LEFTOVER.search(text)
    return plistlib.loads(text.encode())


def systemd_unit(install: dict[str, Path], **extra: object) -> str:
    text = render_systemd(
        UNIT_TEMPLATE, executable=install["exe"], config_path=install["config"], **extra
    )
    assert not LEFTOVER.search(text)
    return text


def parse_unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(text)
    return parser


def test_launchd_plist_has_every_key_with_absolute_paths(install: dict[str, Path]) -> None:
    plist = launchd(install)
    exe, config, logs = install["exe"], install["config"], install["logs"]
    assert plist["Label"] == "dev.radix-mlx.server"
    assert plist["ProgramArguments"][:4] == [str(exe), "serve", "--config", str(config)]
    assert plist["ProgramArguments"][4:] == ["--log-file", str(logs / "server.log")]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] == 10
    assert plist["ProcessType"] == "Interactive"
    assert plist["ExitTimeOut"] == 13  # ceil(drain_timeout 7.5) + 5
    assert plist["StandardOutPath"] == str(logs / "stdout.log")
    assert plist["StandardErrorPath"] == str(logs / "stderr.log")
    assert plist["WorkingDirectory"] == str(config.parent)
    env = plist["EnvironmentVariables"]
    assert env["PATH"].split(":")[0] == str(exe.parent)
    assert env["HOME"] == str(Path.home())
    assert env["HF_HOME"] == str(Path.home() / ".cache" / "huggingface")
    assert plist["SoftResourceLimits"]["NumberOfFiles"] >= 1024
    assert "UserName" not in plist
    paths = [*plist["ProgramArguments"][::3], plist["WorkingDirectory"], env["HOME"]]
    paths += [plist["StandardOutPath"], plist["StandardErrorPath"], env["HF_HOME"]]
    assert all(Path(p).is_absolute() for p in paths)


def test_default_drain_fits_launchd_default_exit_timeout(install: dict[str, Path]) -> None:
    install["config"].write_text("")
    assert Settings().drain_timeout < 20
    assert launchd(install)["ExitTimeOut"] == 20  # launchd's own default, so nothing changes


def test_launch_daemon_variant_runs_as_the_user(install: dict[str, Path]) -> None:
    user = getpass.getuser()
    home = Path(f"~{user}").expanduser()
    plist = launchd(install, user_name=user, hf_home=Path("/srv/hf"), label="com.example.llm")
    assert plist["UserName"] == user
    assert plist["Label"] == "com.example.llm"
    assert plist["EnvironmentVariables"]["HOME"] == str(home)
    assert plist["EnvironmentVariables"]["HF_HOME"] == "/srv/hf"
    with pytest.raises(ValueError, match="unknown user"):
        launchd(install, user_name="no-such-user-radix")


def test_systemd_user_unit_keys(install: dict[str, Path]) -> None:
    unit = parse_unit(systemd_unit(install))
    service = unit["Service"]
    assert shlex.split(service["ExecStart"]) == [
        str(install["exe"]),
        "serve",
        "--config",
        str(install["config"]),
    ]
    assert service["WorkingDirectory"] == str(install["config"].parent)
    assert service["Restart"] == "on-failure"
    assert int(service["RestartSec"]) > 0
    assert service["TimeoutStopSec"] == "13"
    assert service["KillSignal"] == "SIGTERM"
    assert service["ProtectSystem"] == "strict"
    assert service["ProtectHome"] == "read-only"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectKernelTunables", "LockPersonality"):
        assert service[key] == "yes"
    assert service["MemoryDenyWriteExecute"] == "yes"
    assert service["RestrictAddressFamilies"].split() == ["AF_INET", "AF_INET6", "AF_UNIX"]
    writable = shlex.split(service["ReadWritePaths"])
    assert f"-{Path.home() / '.cache'}" in writable
    environment = dict(item.split("=", 1) for item in shlex.split(service["Environment"]))
    assert environment["PATH"].split(":")[0] == str(install["exe"].parent)
    assert environment["HF_HOME"] == str(Path.home() / ".cache" / "huggingface")
    assert "User" not in service
    assert unit["Install"]["WantedBy"] == "default.target"


def test_systemd_system_unit_runs_as_the_user(install: dict[str, Path]) -> None:
    unit = parse_unit(systemd_unit(install, user_name=getpass.getuser()))
    assert unit["Service"]["User"] == getpass.getuser()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("system", [False, True])
def test_systemd_analyze_verify(install: dict[str, Path], tmp_path: Path, system: bool) -> None:
    user = getpass.getuser()
    if system and user == "nobody":
        pytest.skip("systemd warns about User=nobody")
    path = tmp_path / "radix-mlx.service"
    path.write_text(systemd_unit(install, user_name=user if system else None))
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    command = ["systemd-analyze", *([] if system else ["--user"]), "verify", str(path)]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    result = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # Warnings (unknown keys, bad values) leave the exit status 0 but print a line.
    assert str(path) not in result.stdout + result.stderr


def test_systemd_refuses_paths_it_would_reinterpret(install: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="systemd would reinterpret"):
        systemd_unit(install, hf_home=Path("/srv/100%"))


def test_a_bad_config_stops_rendering(install: dict[str, Path]) -> None:
    install["config"].write_text("drain_timeout = -1\n")
    with pytest.raises(ConfigError, match="invalid drain_timeout from file"):
        launchd(install)
    with pytest.raises(ConfigError, match="invalid drain_timeout from file"):
        systemd_unit(install)


def test_health_url_follows_the_config(install: dict[str, Path], tmp_path: Path) -> None:
    assert health_url(install["config"]) == "http://127.0.0.1:8123/health"
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).touch()
    with install["config"].open("a") as config:
        config.write(f'ssl_certfile = "{tmp_path / "cert.pem"}"\n'
                     f'ssl_keyfile = "{tmp_path / "key.pem"}"\n')
    assert health_url(install["config"]) == "https://127.0.0.1:8123/health"


def test_example_config_documents_every_option_and_is_valid(tmp_path: Path) -> None:
    text = (DEPLOY / "config.example.toml").read_text()
    assignments = re.findall(r"^# (\w+ = .*)$", text, flags=re.MULTILINE)
    names = [line.split(" = ")[0] for line in assignments]
    assert sorted(names) == sorted(Settings.model_fields.keys() - {"config_file"})
    # The TLS and template files must exist to validate: stand-ins for the example's paths.
    for name in ("ssl_certfile", "ssl_keyfile", "chat_template", "models_file"):
        (tmp_path / name).touch()
        assignments[names.index(name)] = f'{name} = "{tmp_path / name}"'
    (tmp_path / "models_file").write_text((DEPLOY / "models.example.toml").read_text())
    path = tmp_path / "all.toml"
    path.write_text("\n".join(assignments))
    assert tomllib.loads(path.read_text())
    settings = load_settings(None, environ={"RADIX_MLX_CONFIG_FILE": str(path)})
    defaults = Settings()
    for name in ("drain_timeout", "max_queue", "max_batch_size", "log_level", "port"):
        assert getattr(settings, name) == getattr(defaults, name), name


def test_example_models_file_shows_every_key_of_a_model_and_is_valid(tmp_path: Path) -> None:
    text = (DEPLOY / "models.example.toml").read_text()
    keys = set(re.findall(r"^(?:# )?(\w+) = ", text, flags=re.MULTILINE))
    assert keys == ModelSpec.model_fields.keys()
    models = tmp_path / "models.toml"
    models.write_text(text)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    settings = load_settings(parser.parse_args(["--models-file", str(models), "--kv-bits", "4"]),
                             environ={})
    per_model = {spec.id: settings.for_model(spec) for spec in settings.models}
    assert (per_model["coder"].kv_bits, per_model["gemma"].kv_bits) == (8, None)
    assert per_model["small"].kv_bits == 4  # the server's
    assert per_model["embed"].truncate_embedding_inputs
    assert not per_model["small"].truncate_embedding_inputs  # the server's


def test_newsyslog_entry_is_well_formed() -> None:
    text = (DEPLOY / "launchd" / "radix-mlx.newsyslog.conf").read_text()
    entries = [line.split() for line in text.splitlines() if line and not line.startswith("#")]
    assert len(entries) == 1
    path, owner, mode, count, size, when, flags = entries[0]
    assert path == "@HOME@/Library/Logs/radix-mlx/server.log"
    assert owner == "@USER@:staff" and int(mode, 8) == 0o640
    assert int(count) > 0 and int(size) > 0 and when == "*"
    assert "N" in flags  # no process to signal: the server reopens the file itself


def run_script(kind: str, command: str, install: dict[str, Path], home: Path) -> Path:
    """Run deploy/<kind>/radix-mlx-service with launchctl & co. replaced by recorders."""
    stubs = home / "stubs"
    stubs.mkdir(exist_ok=True)
    calls = home / "calls.log"
    for tool in ("launchctl", "plutil", "systemctl", "loginctl", "journalctl", "curl", "tail"):
        stub = stubs / tool
        # `launchctl print` fails: the job is gone once booted out.
        stub.write_text(
            f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\n'
            f'[ "{tool} $1" = "launchctl print" ] && exit 113\nexit 0\n'
        )
        stub.chmod(0o755)
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "RADIX_MLX_SERVICE_BIN": str(install["exe"]),
        "RADIX_MLX_CONFIG_FILE": str(install["config"]),
    }
    script = DEPLOY / kind / "radix-mlx-service"
    result = subprocess.run(
        ["bash", str(script), command],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return calls


def test_launchd_script_installs_and_uninstalls(install: dict[str, Path], tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    calls = run_script("launchd", "install", install, home)
    plist_path = home / "Library" / "LaunchAgents" / "dev.radix-mlx.server.plist"
    plist = plistlib.loads(plist_path.read_bytes())
    assert plist["ProgramArguments"][0] == str(install["exe"])
    assert plist["StandardErrorPath"] == str(home / "Library/Logs/radix-mlx/stderr.log")
    uid = os.getuid()
    log = calls.read_text()
    assert f"launchctl bootstrap gui/{uid} {plist_path}" in log
    assert f"plutil -lint {plist_path}" in log

    run_script("launchd", "restart", install, home)
    run_script("launchd", "status", install, home)
    run_script("launchd", "uninstall", install, home)
    log = calls.read_text()
    assert f"launchctl kickstart -k gui/{uid}/dev.radix-mlx.server" in log
    assert f"launchctl print gui/{uid}/dev.radix-mlx.server" in log
    assert "curl -sS --insecure --max-time 5 http://127.0.0.1:8123/health" in log
    assert f"launchctl bootout gui/{uid}/dev.radix-mlx.server" in log
    assert not plist_path.exists()


def test_systemd_script_installs_and_uninstalls(install: dict[str, Path], tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    calls = run_script("systemd", "install", install, home)
    unit_path = home / ".config" / "systemd" / "user" / "radix-mlx.service"
    assert parse_unit(unit_path.read_text())["Service"]["TimeoutStopSec"] == "13"
    run_script("systemd", "logs", install, home)
    run_script("systemd", "uninstall", install, home)
    log = calls.read_text().splitlines()
    assert log[:4] == [
        f"loginctl enable-linger {getpass.getuser()}",
        "systemctl --user daemon-reload",
        "systemctl --user enable radix-mlx.service",
        "systemctl --user restart radix-mlx.service",
    ]
    assert "journalctl --user -u radix-mlx.service -n 50 -f" in log
    assert "systemctl --user disable --now radix-mlx.service" in log
    assert not unit_path.exists()


def test_first_install_creates_a_private_config(install: dict[str, Path], tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    install = {**install, "config": home / "cfg" / "config.toml"}
    run_script("systemd", "install", install, home)
    assert install["config"].read_text() == (DEPLOY / "config.example.toml").read_text()
    assert install["config"].stat().st_mode & 0o077 == 0

"""Settings: precedence flag > env > file > default, and one-line errors naming the source."""

import argparse
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from server import config
from server.config import ConfigError, Settings, add_serve_arguments, load_settings


@pytest.fixture(autouse=True)
def no_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the default config path into tmp_path, so the developer's own file is never read."""
    path = tmp_path / "default" / "config.toml"
    monkeypatch.setattr(config, "default_config_path", lambda: path)
    return path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    settings = load_settings(parse(), environ={})
    assert settings == Settings()
    assert (settings.host, settings.port, settings.drain_timeout) == ("127.0.0.1", 8000, 15.0)
    assert settings.config_file is None


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.toml",
        'port = 1111\nmax_queue = 5\nlog_level = "debug"\nserved_model_names = ["file"]\n',
    )
    environ = {
        "RADIX_MLX_PORT": "2222",
        "RADIX_MLX_MAX_QUEUE": "6",
        "RADIX_MLX_SERVED_MODEL_NAMES": "a, b",
    }
    settings = load_settings(parse("--config", str(path), "--port", "3333"), environ)
    assert settings.port == 3333  # flag over env and file
    assert settings.max_queue == 6  # env over file
    assert settings.served_model_names == ["a", "b"]  # env list, comma-separated
    assert settings.log_level == "debug"  # file over default
    assert settings.cache_fraction == 0.5  # default
    assert settings.config_file == path


def test_default_file_is_read_when_present(no_default_file: Path) -> None:
    write(no_default_file, "max_batch_size = 4\n")
    settings = load_settings(None, environ={})
    assert settings.max_batch_size == 4
    assert settings.config_file == no_default_file


def test_empty_config_name_reads_no_file(no_default_file: Path) -> None:
    write(no_default_file, "max_batch_size = 4\n")
    assert load_settings(parse("--config", ""), environ={}).max_batch_size == 32
    assert load_settings(None, environ={"RADIX_MLX_CONFIG_FILE": ""}).config_file is None


def test_config_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path / "env.toml", "prefill_chunk_tokens = 64\n")
    settings = load_settings(None, environ={"RADIX_MLX_CONFIG_FILE": str(path)})
    assert settings.prefill_chunk_tokens == 64


def test_list_flags_repeat_and_split() -> None:
    args = parse("--served-model-name", "a,b", "--served-model-name", "c", "--cors-origin", "x")
    settings = load_settings(args, environ={"RADIX_MLX_SERVED_MODEL_NAMES": "ignored"})
    assert settings.served_model_names == ["a", "b", "c"]
    assert settings.cors_origins == ["x"]


def test_env_conveniences(tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", 'model = "some/model"\n')
    environ = {"RADIX_MLX_MODEL": "", "RADIX_MLX_LOG_LEVEL": "WARNING", "RADIX_MLX_API_KEY": "k"}
    settings = load_settings(parse("--config", str(path)), environ)
    assert settings.model == []  # an empty value unsets it
    assert settings.log_level == "warning"
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k"


def test_unrelated_namespace_attributes_are_ignored() -> None:
    args = argparse.Namespace(command="serve", handler=print, port="9000")
    assert load_settings(args, environ={}).port == 9000


@pytest.mark.parametrize(
    ("argv", "environ", "file_text", "expected"),
    [
        (["--port", "70000"], {}, "", "invalid port from flag --port: "),
        ([], {"RADIX_MLX_MAX_BATCH_SIZE": "0"}, "", "invalid max_batch_size from env RADIX_MLX_"),
        ([], {}, "cache_fraction = 1.5\n", "invalid cache_fraction from file "),
        ([], {}, 'log_level = "loud"\n', "invalid log_level from file "),
        ([], {"RADIX_MLX_DRAIN_TIMEOUT": "inf"}, "", "invalid drain_timeout from env "),
        (["--cache-bytes", "lots"], {}, "", "invalid cache_bytes from flag --cache-bytes: "),
        ([], {}, "served_model_names = 'one'\n", "invalid served_model_names from file "),
        (["--kv-bits", "3"], {}, "", "invalid kv_bits from flag --kv-bits: Value error, must be one of 4, 8"),
        # A blank key would match requests that send none: every route open.
        (["--api-key", ""], {}, "", "invalid api_key from flag --api-key: Value error, an empty"),
        ([], {}, 'api_key = " "\n', "invalid api_key from file "),
        ([], {}, "kv_group_size = 48\n", "invalid kv_group_size from file "),
        ([], {}, "prot = 1\n", "unknown option prot"),
        ([], {}, "port = \n", "config file "),
    ],
)
def test_invalid_values_give_one_clear_line(
    tmp_path: Path, argv: list[str], environ: dict[str, str], file_text: str, expected: str
) -> None:
    path = write(tmp_path / "c.toml", file_text)
    with pytest.raises(ConfigError) as caught:
        load_settings(parse("--config", str(path), *argv), environ)
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message
    if "file" in expected:
        assert str(path) in message


def test_error_shows_bad_value_but_never_the_api_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\(got '70000'\)"):
        load_settings(parse("--port", "70000"), environ={})
    path = write(tmp_path / "c.toml", "api_key = 98765\n")
    with pytest.raises(ConfigError, match="invalid api_key from file") as caught:
        load_settings(parse("--config", str(path)), environ={})
    assert "98765" not in str(caught.value)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"config file {missing} \\(from flag --config\\)"):
        load_settings(parse("--config", str(missing)), environ={})
    with pytest.raises(ConfigError, match="from env RADIX_MLX_CONFIG_FILE"):
        load_settings(None, environ={"RADIX_MLX_CONFIG_FILE": str(missing)})


def test_every_setting_has_a_documented_flag() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    helps = {
        action.dest: action.help
        for action in parser._actions
        if action.dest in Settings.model_fields
    }
    assert helps.keys() == Settings.model_fields.keys() - {"models"}  # a file's tables
    for name, text in helps.items():
        assert f"env RADIX_MLX_{name.upper()}" in text and "default: " in text


def test_settings_are_frozen_and_strict() -> None:
    settings = Settings()
    with pytest.raises(ValidationError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Settings(prot=1)  # type: ignore[call-arg]


def test_kv_bits_reach_the_engine_config() -> None:
    from server.launch.serve import engine_config

    assert (Settings().kv_bits, Settings().kv_group_size) == (None, 64)
    settings = load_settings(parse("--kv-bits", "4", "--kv-group-size", "32"), environ={})
    config = engine_config(settings, "a-model")
    assert (config.kv_bits, config.kv_group_size) == (4, 32)


def test_warm_up_is_the_engines_choice_unless_set() -> None:
    from server.launch.serve import engine_config

    assert engine_config(Settings(), "a-model").warm_up is None
    for flag, value in (("on", True), ("off", False)):
        settings = load_settings(parse("--warm-up", flag), environ={})
        assert engine_config(settings, "a-model").warm_up is value


def test_a_draft_model_is_a_draft_source_of_its_model() -> None:
    """Given a draft model, drafts come from it after the sources named; a `model` source
    without one is an error; a model's own draft model is a source for it alone."""
    from server.launch.serve import engine_config

    settings = load_settings(parse("--speculation-draft-model", "/drafts/small"), environ={})
    speculation = engine_config(settings, "a-model").speculation
    assert (speculation.sources, speculation.draft_model) == (("prompt", "tree", "model"),
                                                              "/drafts/small")
    with pytest.raises(ConfigError, match="no speculation_draft_model"):
        load_settings(parse("--speculation-sources", "prompt,model"), environ={})
    assert load_settings(parse("--speculation-sources", "tree"), environ={}
                         ).speculation_sources == ["tree"]
    several = Settings(models=[{"id": "a", "source": "/m/a", "speculation_draft_model": "/d"},
                               {"id": "b", "source": "/m/b"}])
    a, b = (engine_config(several.for_model(spec), spec.source).speculation
            for spec in several.models)
    assert (a.sources, a.draft_model) == (("prompt", "tree", "model"), "/d")
    assert (b.sources, b.draft_model) == (("prompt", "tree"), "")


def test_several_models_share_the_disk_tiers_budget(tmp_path: Path) -> None:
    """Each model's disk tier is its own folder: each taking the whole budget, five models
    could fill the disk. Those that set no budget of their own share the server's equally;
    a model's own budget is its own."""
    models = [{"id": "a", "source": "/m/a"}, {"id": "b", "source": "/m/b"},
              {"id": "c", "source": "/m/c", "disk_cache_bytes": 7 * 2**30}]
    given = Settings(models=models, disk_cache_bytes=10 * 2**30, disk_cache_dir=tmp_path)
    assert [given.for_model(spec).disk_cache_bytes for spec in given.models] == [
        5 * 2**30, 5 * 2**30, 7 * 2**30]
    default = Settings(models=models, disk_cache_dir=tmp_path)
    budget = config.default_disk_budget(tmp_path)
    shares = [default.for_model(spec).disk_cache_bytes for spec in default.models]
    assert shares[2] == 7 * 2**30
    assert abs(shares[0] - budget // 2) < 2**20 and shares[0] == shares[1]  # free space moves
    off = Settings(models=models, disk_cache_bytes=0, disk_cache_dir=tmp_path)
    assert [off.for_model(spec).disk_cache_bytes for spec in off.models] == [0, 0, 7 * 2**30]
    # One model the old way keeps the whole budget, as it always did.
    assert Settings(disk_cache_bytes=10 * 2**30).for_model(
        Settings().model_specs()[0]).disk_cache_bytes == 10 * 2**30


@pytest.mark.parametrize(("options", "words"), [
    ({"served_model_names": ["b"]}, "served_model_names b name another model than a"),
    ({"unnamed_model_aliases": ["b"]}, "unnamed_model_aliases b name a model"),
    ({"models": [{"id": "x/y", "source": "/m/a"}, {"id": "x--y", "source": "/m/b"}]},
     "model ids x--y, x/y would share one disk cache folder"),
    ({"models": [{"id": "..", "source": "/m/a"}, {"id": "b", "source": "/m/b"}]},
     "a model id cannot be '..'"),
])
def test_names_that_would_route_or_cache_as_another_model_are_refused(
    options: dict, words: str
) -> None:
    """A served name or an unnamed alias that is another model's name answered its
    requests with the first model; two ids written as one folder name shared a disk
    tier, and the second could never load."""
    models = options.pop("models", [{"id": "a", "source": "/m/a"}, {"id": "b", "source": "/m/b"}])
    with pytest.raises(ValueError, match=re.escape(words)):
        Settings(models=models, **options)
    assert Settings(models=[{"id": "a", "source": "/m/a"}], served_model_names=["a", "c"])

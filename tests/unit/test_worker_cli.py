"""``conveyor worker``'s options: grouped help, the config file and its precedence, the docs.

The flags are generated from WorkerSettings, so these tests hold for fields added
later too: a field without a help section, a description or a line in
docs/settings.md fails here.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from pydantic_settings import SettingsError

from producers.cli import build_parser
from workers import cli, exits, settings_doc
from workers.config.worker import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def help_text(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal; fix it
    parser = argparse.ArgumentParser(prog="conveyor worker")
    cli.add_arguments(parser)
    return parser.format_help()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No CONVEYOR_* variable of the machine running the tests leaks into the settings."""
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_field_is_in_exactly_one_help_section() -> None:
    placed = list(cli.fields_in_groups())
    assert len(placed) == len(set(placed)), "a field is in two sections of FLAG_GROUPS"
    missing = WorkerSettings.model_fields.keys() - set(placed)
    assert not missing, f"add {sorted(missing)} to workers.cli.FLAG_GROUPS (or NESTED)"
    unknown = set(placed) - WorkerSettings.model_fields.keys()
    assert not unknown, f"FLAG_GROUPS names {sorted(unknown)}, which are not settings"


def test_every_field_has_a_description() -> None:
    undescribed = [n for n, f in WorkerSettings.model_fields.items() if not f.description]
    assert not undescribed, f"describe {undescribed} in workers/config/worker.py: --help shows it"


def test_help_is_grouped_in_order(help_text: str) -> None:
    titles = [*cli.FLAG_GROUPS, "limits (variables or config file only)", "other variables"]
    positions = [help_text.index(f"\n{title}:\n") for title in titles]
    assert positions == sorted(positions)
    assert [*cli.FLAG_GROUPS][:7] == [
        "model",
        "processes and cards",
        "batching",
        "Kafka",
        "Redis",
        "security",
        "observability",
    ]
    # The model section starts with --model.
    model_section = help_text[positions[0] + 1 :]
    assert model_section.split("\n")[1].lstrip().startswith("--model MODEL")


def test_help_shows_defaults_variables_and_plain_text(help_text: str) -> None:
    assert "`" not in help_text  # no reStructuredText literals
    section = help_text[help_text.index("\nbatching:\n") :]
    entry = section[section.index("--max-batch-size") : section.index("--max-delay-ms")]
    assert "(default: 32)" in entry
    assert "[env CONVEYOR_MAX_BATCH_SIZE]" in " ".join(entry.split())
    # A computed default reads as its rule, not this host's value (an expert flag: --help-all).
    everything = " ".join(help_all_text().split())
    assert "(default: min(8, CPU count))" in everything
    model_section = help_text[help_text.index("\nmodel:\n") :]
    assert "(required)" in model_section.split("--model-name")[0]
    assert "{auto,float32,float16,bfloat16}" in help_text
    for name in ("MAX_PAYLOAD_BYTES", "MAX_PIXELS", "MAX_PARAMS_DEPTH"):
        assert f"CONVEYOR_LIMITS__{name}" in help_text
    assert "CONVEYOR_MODEL_DIR" in help_text
    for code in exits.EXIT_STATUSES:
        assert f"\n  {code} " in help_text


def test_the_conveyor_command_uses_the_grouped_parser() -> None:
    parser = build_parser()
    [worker] = [
        action.choices["worker"]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    assert "\nbatching:\n" in worker.format_help()


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return path


def test_precedence_flag_then_variable_then_file_then_default(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = _config(
        tmp_path,
        'model = "digits"\nmax_batch_size = 8\nmax_delay_ms = 7.5\nresult_ttl_s = 60\n'
        "[limits]\nmax_pixels = 1000\nmax_params_depth = 3\n",
    )
    clean_env.setenv("CONVEYOR_MAX_BATCH_SIZE", "16")
    clean_env.setenv("CONVEYOR_MAX_DELAY_MS", "2")
    clean_env.setenv("CONVEYOR_LIMITS__MAX_PIXELS", "2000")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--config-file", str(config), "--max-batch-size", "64"])

    settings = cli.settings_from_args(args)

    assert settings.max_batch_size == 64  # flag over variable and file
    assert settings.max_delay_ms == 2.0  # variable over file
    assert settings.result_ttl_s == 60  # file over default
    assert settings.model == "digits"  # a required setting may come from the file
    assert settings.limits.max_pixels == 2000  # a nested variable over the file's table
    assert settings.limits.max_params_depth == 3  # the rest of the table still counts
    assert settings.max_in_flight == WorkerSettings.model_fields["max_in_flight"].default


def test_config_file_may_come_from_the_environment(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("CONVEYOR_CONFIG_FILE", str(_config(tmp_path, 'model = "m:Handler"\n')))
    assert WorkerSettings().model == "m:Handler"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_batch_sise = 8\n", "max_batch_sise is not a setting"),
        ('config_file = "other.toml"\n', "config_file is not a setting"),
        ("max_batch_size = \n", "is not valid TOML"),
    ],
)
def test_config_file_mistakes_name_the_file(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, text: str, message: str
) -> None:
    config = _config(tmp_path, text)
    with pytest.raises(SettingsError, match=message) as error:
        WorkerSettings(model="digits", config_file=config)
    assert str(config) in str(error.value)


def test_a_missing_config_file_is_an_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="No such file"):
        WorkerSettings(model="digits", config_file=tmp_path / "absent.toml")


def test_a_bad_value_in_the_file_is_a_validation_error(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = _config(tmp_path, 'model = "digits"\nmax_batch_size = 0\n')
    status = cli.run(parser.parse_args(["--config-file", str(config)]))
    assert status == exits.EXIT_BAD_SETTINGS
    assert "max_batch_size" in capsys.readouterr().err


def test_a_config_mistake_exits_with_one_line(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", "digits", "--config-file", str(tmp_path / "no.toml")])
    assert cli.run(args) == exits.EXIT_BAD_SETTINGS
    err = capsys.readouterr().err
    assert err.startswith("conveyor worker: config file ")
    assert err.count("\n") == 1


def test_the_documented_example_config_is_valid(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = _config(tmp_path, "\n".join(settings_doc.EXAMPLE_CONFIG))
    settings = WorkerSettings(config_file=config)
    assert settings.max_batch_size == 64
    assert settings.limits.max_payload_bytes == 4 * 1024 * 1024


def test_settings_reference_is_current() -> None:
    documented = (ROOT / "docs" / "settings.md").read_text()
    assert documented == settings_doc.settings_reference(), (
        "docs/settings.md is stale: run `make settings-doc` and commit the result"
    )


def help_all_text() -> str:
    parser = argparse.ArgumentParser(prog="conveyor worker", add_help=False)
    cli.add_arguments(parser, expert=True)
    return parser.format_help()


def test_expert_flags_are_accepted_but_listed_only_by_help_all(help_text: str) -> None:
    shown, listed = _options(help_text), _options(help_all_text())
    for name in cli.EXPERT:
        flag = "--" + name.replace("_", "-")
        assert flag not in shown, flag
        assert flag in listed, flag
    assert "--help-all lists" in help_text
    args = argparse.ArgumentParser()
    cli.configure(args)
    parsed = args.parse_args(["--model", "digits", "--stage-batches", "3", "--no-fetch-buffers"])
    settings = cli.settings_from_args(parsed)
    assert (settings.stage_batches, settings.fetch_buffers) == (3, False)
    assert len(shown) <= 55  # the main help stays a page: tuning goes to --help-all


def _options(help_text: str) -> set[str]:
    """The flags a help text lists as options (not the ones its descriptions mention)."""
    return {
        line.split()[0].rstrip(",") for line in help_text.splitlines() if line.startswith("  --")
    }

"""The host file: ``[[models]]`` tables, each model's settings, and what a reload does."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_settings import SettingsError

from workers.config.host import read_host_file, reload_plan
from workers.config.worker import WorkerSettings

FIELDS = set(WorkerSettings.model_fields)

HOST = """
kafka_bootstrap = "broker:9092"
max_batch_size = 16

[[models]]
model = "digits"

[[models]]
model = "embedding:resnet18"
model_name = "faces"
weights = "random"
max_batch_size = 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "host.toml"
    path.write_text(text)
    return path


def test_each_model_reads_the_shared_settings_with_its_own_table_over_them(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, HOST)
    host = read_host_file(path, FIELDS)
    assert host is not None
    assert [m.name for m in host.models] == ["digits", "faces"]
    digits = WorkerSettings(config_file=path, host_model="digits")
    faces = WorkerSettings(config_file=path, host_model="faces")
    assert (digits.model, digits.max_batch_size, digits.kafka_bootstrap) == (
        "digits",
        16,
        "broker:9092",
    )
    assert (faces.served_name, faces.max_batch_size, faces.weights) == ("faces", 64, "random")
    # A flag still wins over the file, for every model.
    assert (
        WorkerSettings(config_file=path, host_model="faces", max_batch_size=8).max_batch_size == 8
    )


def test_a_plain_config_file_is_no_host_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'model = "digits"\n')
    assert read_host_file(path, FIELDS) is None
    with pytest.raises(SettingsError, match="needs \\[\\[models\\]\\] tables"):
        WorkerSettings(config_file=path, host_model="digits")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('model = "digits"\n[[models]]\nmodel = "digits"\n', "move model"),
        ("[[models]]\nmax_batch_size = 8\n", "table 1: model is missing"),
        ('[[models]]\nmodel = "digits"\nbatch = 8\n', "table 1: batch is not a setting"),
        ('[[models]]\nmodel = "digits"\n[[models]]\nmodel = "demo"\nmodel_name = "digits"\n',
         "a second model named 'digits'"),
        ('models = "digits"\n', "must be \\[\\[models\\]\\] tables"),
        ('[[models]]\nmodel = "digits"\nhost_model = "x"\n', "host_model is not a setting"),
    ],
)  # fmt: skip
def test_a_host_file_that_is_wrong_says_where(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        read_host_file(write(tmp_path, text), FIELDS)


def test_asking_for_a_model_the_file_does_not_have_lists_those_it_has(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no model named 'cats' \\(it has digits, faces\\)"):
        WorkerSettings(config_file=write(tmp_path, HOST), host_model="cats")


def test_a_reload_starts_what_was_added_stops_what_was_removed_and_touches_only_changes(
    tmp_path: Path,
) -> None:
    before = read_host_file(write(tmp_path, HOST), FIELDS)
    changed = HOST.replace("max_batch_size = 64", "max_batch_size = 32").replace(
        '[[models]]\nmodel = "digits"\n', '[[models]]\nmodel = "demo"\nmodel_name = "extra"\n'
    )
    after = read_host_file(write(tmp_path, changed), FIELDS)
    assert before is not None
    assert after is not None
    plan = reload_plan(before, after)
    assert (plan.added, plan.removed, plan.changed, plan.unchanged) == (
        ["extra"],
        ["digits"],
        ["faces"],
        [],
    )
    assert plan.describe() == (
        "start extra; drain and stop digits; restart one process a card at a time faces"
    )
    assert reload_plan(before, before).describe() == "leave alone digits, faces"
    # A shared setting changes every model.
    shared = read_host_file(write(tmp_path, HOST.replace("16", "24")), FIELDS)
    assert shared is not None
    assert reload_plan(before, shared).changed == ["digits", "faces"]


def test_a_reload_says_which_models_change_their_process_count_or_cards(tmp_path: Path) -> None:
    before = read_host_file(write(tmp_path, HOST), FIELDS)
    more = HOST.replace("max_batch_size = 64", "max_batch_size = 64\nprocesses = 3")
    after = read_host_file(
        write(tmp_path, more.replace("max_batch_size = 16", 'gpus = "1"')), FIELDS
    )
    assert before is not None
    assert after is not None
    plan = reload_plan(before, after)
    assert plan.changed == ["digits", "faces"]
    assert plan.resized == ["digits", "faces"]  # faces: its count; both: the shared cards
    assert plan.describe() == (
        "drain, then start with the new process count or cards digits, faces"
    )
    batch_only = read_host_file(write(tmp_path, HOST.replace("= 64", "= 32")), FIELDS)
    assert batch_only is not None
    assert reload_plan(before, batch_only).resized == []


def test_check_prints_each_models_processes_and_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.cli import main

    assert main(["--config-file", str(write(tmp_path, HOST)), "--device", "cpu", "--check"]) == 0
    out = capsys.readouterr().out
    assert "model digits (digits): 1 process on cpu; group conveyor.digits" in out
    assert "model faces (embedding:resnet18): 1 process on cpu" in out
    assert main(["--config-file", str(write(tmp_path, HOST)), "--model", "demo", "--check"]) == 2
    assert "--model demo (or CONVEYOR_MODEL) with the host file" in capsys.readouterr().err


def test_check_says_what_a_pipeline_sends_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.cli import main

    chained = HOST.replace(
        '[[models]]\nmodel = "digits"\n',
        '[[models]]\nmodel = "digits"\nthen = "faces"\n'
        'then_options = { min_score = 0.3, classes = ["7"] }\n',
    )
    assert main(["--config-file", str(write(tmp_path, chained)), "--device", "cpu", "--check"]) == 0
    out = capsys.readouterr().out
    assert (
        "; then faces: up to 16 boxes of 7 scoring 0.3 or more, to conveyor.faces.requests" in out
    )
    bad = chained.replace("min_score = 0.3", "min_score = 3")
    assert main(["--config-file", str(write(tmp_path, bad)), "--device", "cpu", "--check"]) == 2
    assert "then_options min_score is a number from 0 to 1, not 3" in capsys.readouterr().err


def test_a_reload_with_an_invalid_setting_says_what_check_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import argparse
    import asyncio

    from workers.cli import configure, main, settings_from_args
    from workers.fleet.exposition import FleetMetrics
    from workers.fleet.host import Host
    from workers.fleet.state import State
    from workers.fleet.supervisor import _Making, _reload

    path = write(tmp_path, HOST)
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--config-file", str(path), "--device", "cpu"])
    found = read_host_file(path, FIELDS)
    assert found is not None
    host = Host(path, found, lambda name: settings_from_args(args, host_model=name), 2)
    path.write_text(HOST.replace("max_batch_size = 64", 'max_batch_size = "many"'))
    assert main(["--config-file", str(path), "--device", "cpu", "--check"]) == 2
    [checked] = capsys.readouterr().err.splitlines()  # one line
    said = checked.removeprefix("conveyor worker: ")
    assert said.startswith("invalid worker settings of model faces ([[models]] table")
    assert "max_batch_size (--max-batch-size or CONVEYOR_MAX_BATCH_SIZE): Input should be" in said

    state = State(host=host)
    metrics = FleetMetrics("host", list)
    with caplog.at_level("ERROR", logger="conveyor.fleet"):
        asyncio.run(_reload(state, metrics, _Making([], [], 1, {})))
    [logged] = [r.getMessage() for r in caplog.records if r.name == "conveyor.fleet"]
    assert logged == f"SIGHUP: the host file is not reloaded, nothing changes: {said}"
    assert state.host is host
    assert host.file is found  # nothing changed

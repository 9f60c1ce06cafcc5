"""``conveyor`` on an install without the worker: it says what to install, and imports no worker.

Each case runs ``producers.cli.main`` in a fresh interpreter whose import system
refuses some modules (a meta-path finder put first), as if they were not
installed: the ``workers`` package itself, or the worker extra's torch and
torchvision (today's client-only install, where the package is there but its
extra is not). ``tests/packaging/test_install.py`` checks the same on a real
client-only install built from the sources. A worker asked for spans (``--tracing``)
without OpenTelemetry says which extra to install in the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.install import install_hint
from producers.cli import EXIT_NOT_INSTALLED

REPO = Path(__file__).resolve().parents[2]

_RUN_WITHOUT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from importlib.abc import MetaPathFinder

    BLOCKED = set(sys.argv[1].split(","))

    class NotInstalled(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    from producers.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(sys.argv[2:])
        except SystemExit as exc:
            status = exc.code
    loaded = sorted({m.partition(".")[0] for m in sys.modules} & (BLOCKED | {"workers"}))
    print(json.dumps({"status": status, "stderr": err.getvalue(), "loaded": loaded}))
    """
)


def _conveyor_without(blocked: str, *argv: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT, blocked, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    outcome: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return outcome


@pytest.mark.parametrize("blocked", ["workers", "torch,torchvision"])
def test_worker_without_the_worker_says_what_to_install(blocked: str) -> None:
    outcome = _conveyor_without(blocked, "worker", "--model", "digits", "--max-batch-size", "8")
    assert outcome["status"] == EXIT_NOT_INSTALLED
    [line] = str(outcome["stderr"]).splitlines()
    assert line.startswith("conveyor worker: needs the worker extra")
    assert line.endswith(install_hint("worker"))
    # Nothing refused was imported: the command never got past the missing part.
    assert outcome["loaded"] == ([] if blocked == "workers" else ["workers"])


@pytest.mark.parametrize("exporter", ["otlp", "console"])
def test_worker_tracing_without_the_tracing_extra_says_what_to_install(exporter: str) -> None:
    outcome = _conveyor_without(
        "opentelemetry", "worker", "--model", "digits", "--tracing", exporter
    )
    assert outcome["status"] == EXIT_NOT_INSTALLED
    [line] = str(outcome["stderr"]).splitlines()
    assert line.startswith(f"conveyor worker: --tracing {exporter} needs the tracing extra")
    assert line.endswith(install_hint("tracing"))


def test_worker_quantize_without_the_quant_extra_says_what_to_install() -> None:
    outcome = _conveyor_without("torchao", "worker", "--model", "digits", "--quantize", "int8")
    assert outcome["status"] == EXIT_NOT_INSTALLED
    [line] = str(outcome["stderr"]).splitlines()
    assert line.startswith("conveyor worker: --quantize int8 (digits) needs the quant extra")
    assert line.endswith(install_hint("quant"))


@pytest.mark.parametrize(
    ("blocked", "spec", "extra"),
    [("transformers", "hf:./m", "hf"), ("timm", "timm:resnet18", "timm")],
)
def test_worker_of_a_spec_without_its_extra_says_what_to_install(
    blocked: str, spec: str, extra: str
) -> None:
    outcome = _conveyor_without(blocked, "worker", "--model", spec)
    assert outcome["status"] == EXIT_NOT_INSTALLED
    [line] = str(outcome["stderr"]).splitlines()
    assert line.startswith(f"conveyor worker: --model {spec} needs the {extra} extra")
    assert line.endswith(install_hint(extra))


def test_client_commands_work_without_the_worker_package() -> None:
    outcome = _conveyor_without("workers", "--redis-url", "redis://127.0.0.1:9/0", "result", "a")
    assert outcome["status"] == 4  # Redis unreachable: the command ran
    assert "cannot reach Redis at redis://127.0.0.1:9/0" in str(outcome["stderr"])
    assert outcome["loaded"] == []


def test_help_lists_the_worker_even_when_it_is_missing() -> None:
    outcome = _conveyor_without("workers", "worker", "--help")
    assert outcome["status"] == 0
    assert outcome["loaded"] == []


def test_an_unknown_option_of_a_client_command_is_still_refused() -> None:
    outcome = _conveyor_without("workers", "result", "a", "--no-such-option")
    assert outcome["status"] == 2
    assert "unrecognized arguments: --no-such-option" in str(outcome["stderr"])

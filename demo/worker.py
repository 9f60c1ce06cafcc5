"""A worker as a child process of a demo, launched as the tests and benchmarks launch theirs
(``producers.testing``): started, watched, and drained when the demo ends."""

from __future__ import annotations

from pathlib import Path

from producers.settings import ClientSettings
from producers.testing import WorkerConfig, WorkerProcess

REPO = Path(__file__).resolve().parents[1]


class DemoError(Exception):
    """The demo could not run to the end; the message says why and where to look."""


def worker_config(
    settings: ClientSettings, model_name: str, model: str, device: str, *options: str
) -> WorkerConfig:
    """``conveyor worker --model model`` serving ``model_name`` on the services of ``settings``
    (and its topic prefix), imported from this checkout; its metrics on any free port."""
    return WorkerConfig(
        model_name,
        settings.kafka_bootstrap,
        settings.redis_url.get_secret_value(),
        model=model,
        device=device,
        options=("--topic-prefix", settings.topic_prefix, *options),
        cwd=REPO,
    )


def launch(config: WorkerConfig, log_path: Path) -> WorkerProcess:
    """A worker of ``config`` (start it with ``async with``), its log in ``log_path`` (this
    run's only). It runs in a session of its own, so a Ctrl-C at the terminal reaches only
    the demo, which then stops the worker with one SIGTERM as it leaves: a clean drain.
    ``unless_it_dies`` raises ``producers.testing.WorkerExited`` if it exits early."""
    log_path.unlink(missing_ok=True)
    return WorkerProcess(config, log_path, new_session=True)

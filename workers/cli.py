"""``conveyor worker``: flags, CONVEYOR_* variables and a config file → WorkerSettings → the worker.

Flags are generated from WorkerSettings' fields, so a field, its flag
(``--max-batch-size``), its variable (``CONVEYOR_MAX_BATCH_SIZE``) and its key in
the config file (``max_batch_size``) never drift apart. A flag wins over the
variable, which wins over the config file (``--config-file``), which wins over
the default. ``FLAG_GROUPS`` sorts the flags into the sections of ``--help``;
every field must be in exactly one of them (a unit test checks), and the
settings reference (docs/settings.md) is generated from the same data.

Exit status of ``conveyor worker``, for supervisors and scripts: see ``EXIT_STATUSES``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.util
import json
import os
import sys
import textwrap
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import SettingsError

import common
import schemas
from common.install import install_hint
from common.security import ConnectFailed
from schemas import Limits
from workers.config.host import HOST_FILE_PATH, HostFile, read_host_file, reload_from
from workers.config.next_stage import NextStage
from workers.config.worker import MODEL_DIR_VARIABLE, WorkerSettings, describe_error
from workers.exits import (
    EXIT_BAD_SETTINGS,
    EXIT_CONFIG,
    EXIT_DEVICE,
    EXIT_ENVIRONMENT,
    EXIT_LOAD_DEVICE,
    EXIT_NOT_INSTALLED,
    EXIT_STATUSES,
    EXIT_STOPPED,
    EXIT_UNREACHABLE,
)
from workers.fleet.plan import Card, Slot
from workers.observe.logs import configure_logging

FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "model": (
        "model",
        "model_name",
        "weights",
        "model_options",
        "preprocess",
        "task",
        "max_length",
        "truncation",
        "device",
        "dtype",
        "quantize",
        "channels_last",
        "decode",
        "compile",
        "compile_form",
        "compile_cache",
        "cuda_graphs",
        "cuda_sync",
        "allow_pickle_models",
    ),
    "processes and cards": ("processes", "gpus", "mps", "profile"),
    "batching": (
        "max_batch_size",
        "max_batch_tokens",
        "max_delay_ms",
        "close_idle_batches",
        "stage_batches",
        "stage_partial_batches",
        "max_in_flight",
        "max_age_ms",
        "in_flight_target_ms",
        "decode_threads",
        "decode_memory_mb",
        "event_loop",
        "switch_interval_ms",
        "lanes",
        "supersede_frames",
    ),
    "Kafka": (
        "kafka_bootstrap",
        "topic_prefix",
        "session_timeout_ms",
        "max_poll_interval_ms",
        "rebalance_timeout_ms",
        "max_drain_ms",
        "group_instance_id",
        "fetch_buffers",
        "permanent_error_grace_s",
        "delivery",
        "publishes_in_flight",
        "transaction_timeout_ms",
    ),
    "Redis": ("redis_url", "redis_cluster", "redis_replica_acks", "result_ttl_s"),
    "security": (
        "kafka_security_protocol",
        "kafka_sasl_mechanism",
        "kafka_username",
        "kafka_password",
        "kafka_ca_file",
        "kafka_cert_file",
        "kafka_key_file",
        "redis_username",
        "redis_password",
        "redis_ca_file",
        "redis_cert_file",
        "redis_key_file",
    ),
    "observability": (
        "worker_id",
        "log_level",
        "log_format",
        "tracing",
        "metrics_host",
        "metrics_port",
        "unready_after_s",
    ),
    "payloads by reference, cancellation and status": (
        "dataref_redis_prefix",
        "dataref_s3_buckets",
        "s3_endpoint_url",
        "s3_region",
        "s3_access_key_id",
        "s3_secret_access_key",
        "s3_addressing_style",
        "cancellation",
        "track_status",
    ),
    "canary and shadow": ("canary", "shadow"),
    "pipelines": ("then", "then_options"),
    "configuration": ("config_file", "host_model"),
}
"""Sections of ``conveyor worker --help``, in order, each with its fields in order."""

EXPERT = frozenset(
    {
        "task",  # hf: models: auto reads it from the folder
        "max_length",
        "truncation",
        "max_batch_tokens",
        "channels_last",
        "compile_form",
        "close_idle_batches",  # on: only a benchmark of the timer wants it off
        "compile_cache",
        "cuda_graphs",
        "cuda_sync",
        "stage_batches",
        "stage_partial_batches",
        "in_flight_target_ms",
        "decode_threads",
        "decode_memory_mb",
        "event_loop",
        "switch_interval_ms",
        "session_timeout_ms",
        "max_poll_interval_ms",
        "rebalance_timeout_ms",
        "max_drain_ms",
        "fetch_buffers",
        "permanent_error_grace_s",
        "publishes_in_flight",
        "transaction_timeout_ms",
        "unready_after_s",
        "preprocess",
        "metrics_host",
        "worker_id",
        "group_instance_id",
        "redis_replica_acks",
        "dataref_redis_prefix",
        "s3_region",
        "s3_addressing_style",
        "host_model",
    }
)
"""Tuning the profiles and defaults take care of: accepted as any flag, listed only by
``--help-all`` (and in docs/settings.md, marked)."""

NESTED = {"limits": Limits}
"""Fields set only through ``CONVEYOR_<FIELD>__<NAME>`` variables or a config file table."""

ENVIRONMENT_ONLY = {
    MODEL_DIR_VARIABLE: "folder where the demo model (--model digits) is built on first use "
    "and then loaded from; the worker must be allowed to write it unless the model is "
    "already there (default: $XDG_CACHE_HOME/conveyor-serve/models, else "
    "~/.cache/conveyor-serve/models)",
}
"""Variables that are no setting of their own, with what they do."""

REQUIRED = "required"
# The top-level names of Conveyor's own modules (however the packages are installed).
_OWN_ROOTS = {m.__name__.partition(".")[0] for m in (common, schemas)} | {
    __name__.partition(".")[0]
}
_HELP_WIDTH = 78
_ASK_HOST_S = 1.0  # --check: how long a running host has to say what it runs

_DESCRIPTION = (
    "Consume a model's requests from Kafka, run them in micro-batches, and publish each "
    "result to Redis and to the reply topic."
)
PRECEDENCE = (
    "Every option is also a CONVEYOR_<NAME> environment variable and a key of the "
    "TOML file given with --config-file. A flag wins over the variable, the variable over "
    "the file, the file over the default."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` the ``conveyor worker`` command (the entry point ``producers.cli`` loads)."""
    add_arguments(parser)
    parser.set_defaults(handler=run)


def add_arguments(parser: argparse.ArgumentParser, *, expert: bool = False) -> None:
    """Give ``parser`` one flag per WorkerSettings field, in the sections of FLAG_GROUPS;
    the ``EXPERT`` ones are accepted but listed only with ``expert`` (``--help-all``)."""
    parser.description = f"{_wrap(_DESCRIPTION)}\n\n{_wrap(PRECEDENCE)}"
    if not expert:
        parser.description += "\n\n" + _wrap(
            f"--help-all lists {len(EXPERT)} more options: tuning that the profiles and "
            "defaults take care of."
        )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
    parser.add_argument(
        "--help-all",
        action=_HelpAll,
        nargs=0,
        help="show every option, the expert tuning included, and exit",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the settings (each model's, for a host file) and print the processes "
        "the command would run, then exit: what SIGHUP would load, before it is sent",
    )
    fields = WorkerSettings.model_fields
    for title, names in FLAG_GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            _add_flag(group, name, fields[name], shown=expert or name not in EXPERT)
    for name, model in NESTED.items():
        parser.add_argument_group(
            f"{name} (variables or config file only)", _nested_help(name, model)
        )
    parser.add_argument_group("other variables", _other_variables_help())


class _HelpAll(argparse.Action):
    """``--help-all``: the help of the same command with every flag listed."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        full = argparse.ArgumentParser(prog=parser.prog, add_help=False)
        add_arguments(full, expert=True)
        full.print_help()
        parser.exit()


def _add_flag(
    group: argparse._ArgumentGroup, name: str, info: FieldInfo, *, shown: bool = True
) -> None:
    flag = "--" + name.replace("_", "-")
    default = default_text(info)
    help_text = plain(describe(name, info))
    if default == REQUIRED:
        help_text += " (required)"
    elif default:
        help_text += f" (default: {default})"
    help_text += f" [env {env_name(name)}]"
    # argparse formats help with %: a literal percent sign must be doubled.
    help_text = help_text.replace("%", "%%") if shown else argparse.SUPPRESS
    # default=None everywhere: an absent flag must not hide the variable or the file.
    if info.annotation in (bool, bool | None):
        group.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    choices = get_args(info.annotation) if "Literal" in str(info.annotation) else None
    metavar = None if choices else name.upper()  # choices show as {a,b,c}
    group.add_argument(flag, default=None, choices=choices or None, help=help_text, metavar=metavar)


def _nested_help(name: str, model: type[BaseModel]) -> str:
    lines = [_wrap(f"Set with these variables, or as keys of a [{name}] table in the config file:")]
    for field, info in model.model_fields.items():
        lines.append(f"  {env_name(name)}__{field.upper()} (default: {default_text(info)})")
        lines.append(_wrap(plain(describe(field, info)), indent=6))
    return "\n".join(lines)


def _other_variables_help() -> str:
    lines = []
    for variable, meaning in ENVIRONMENT_ONLY.items():
        lines.append(f"  {variable}")
        lines.append(_wrap(meaning, indent=6))
    return "\n".join(lines)


def _epilog() -> str:
    lines = ["exit status:"]
    for code, meaning in EXIT_STATUSES.items():
        lines.append(_wrap(f"{code:<3} {meaning}", indent=2, hanging=6))
    return "\n".join(lines)


def _wrap(text: str, indent: int = 0, hanging: int | None = None) -> str:
    return textwrap.fill(
        text,
        _HELP_WIDTH,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent if hanging is None else hanging),
        break_on_hyphens=False,
    )


def env_name(name: str) -> str:
    return f"CONVEYOR_{name.upper()}"


def describe(name: str, info: FieldInfo) -> str:
    """The field's description on one line, without a final full stop (reST literals kept)."""
    text = info.description or name.replace("_", " ")
    return " ".join(text.split()).removesuffix(".")


def plain(text: str) -> str:
    """``literal`` markup as plain text, for --help."""
    return text.replace("``", "")


def default_text(info: FieldInfo) -> str:
    """How the default reads in help and docs: '' when there is none to show.

    A default computed when the worker starts (the host name, the CPU count) is
    shown as the first line of its factory's docstring, never as this machine's value.
    """
    if info.default_factory is not None:
        doc = info.default_factory.__doc__ or "computed at start"
        return doc.strip().splitlines()[0].rstrip(".")
    default = info.default
    if default is PydanticUndefined:
        return REQUIRED
    if default is None:
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, SecretStr):
        return default.get_secret_value()
    if isinstance(default, BaseModel):
        return ""
    return str(default)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags: field -> value as parsed."""
    return {
        name: value
        for name, value in vars(args).items()
        if name in WorkerSettings.model_fields and value is not None
    }


class _ModelSettingsError(ValueError):
    """A host file's model's settings are invalid: the message names the model."""


def _host_settings(args: argparse.Namespace, host: HostFile) -> list[WorkerSettings]:
    """Each model's settings of the host file; raises ``_ModelSettingsError`` naming the
    first model whose settings are invalid, as a reload's log does."""
    models = []
    for model in host.models:
        try:
            models.append(settings_from_args(args, host_model=model.name))
        except ValidationError as exc:
            raise _ModelSettingsError(describe_error(exc, model.name)) from None
    return models


def settings_from_args(args: argparse.Namespace, host_model: str | None = None) -> WorkerSettings:
    """The settings of ``args`` (for a host file: its model ``host_model``'s)."""
    given = _given(args)
    if host_model is not None:
        given["host_model"] = host_model
    if "redis_url" in given:
        given["redis_url"] = SecretStr(given["redis_url"])
    return WorkerSettings(**given)


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for, or for ``auto`` when installed; None: asyncio's."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError(
                "event_loop uvloop needs the uvloop package: pip install uvloop"
            ) from None
        return None
    return uvloop.new_event_loop


_WORKER_EXTRA = ("torch", "torchvision", "PIL", "numpy", "prometheus_client")
"""Modules of the worker extra's packages that the worker cannot run without, found without
importing them (uvloop, hiredis and google-crc32c are used where installed)."""


def _require_worker_extra() -> None:
    """Raises ``ModuleNotFoundError`` naming the first of ``_WORKER_EXTRA`` not installed."""
    for name in _WORKER_EXTRA:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def run(args: argparse.Namespace) -> int:
    try:
        host = host_of(args)
        models = _host_settings(args, host) if host is not None else [settings_from_args(args)]
    except ValidationError as exc:
        return _fail(describe_error(exc), EXIT_BAD_SETTINGS)
    except _ModelSettingsError as exc:
        return _fail(str(exc), EXIT_BAD_SETTINGS)
    except SettingsError as exc:  # the config file: missing, unreadable, not TOML, unknown keys
        return _fail(str(exc), EXIT_BAD_SETTINGS)
    settings = models[0]
    configure_logging(settings.log_level, settings.log_format)
    try:
        # torch is imported only when a worker really starts, so the client-only
        # install has the rest of the command (and this command's --help); a host's
        # supervisor never imports it (its fork server does, meanwhile: 3-5 s on a GPU host).
        _require_worker_extra()
        import workers.fleet.supervisor  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] in _OWN_ROOTS:
            raise  # a module of Conveyor's own: a broken install, not a missing extra
        return _fail(
            f"needs the worker extra, which is not installed (no module {exc.name!r}): "
            f"{install_hint('worker')}",
            EXIT_NOT_INSTALLED,
        )
    missing = _missing_extra(models)
    if missing is not None:
        return _fail(missing, EXIT_NOT_INSTALLED)
    return _serve_or_fail(args, host, models)


def _serve_or_fail(
    args: argparse.Namespace, host: HostFile | None, models: list[WorkerSettings]
) -> int:
    """Serve, or say in one line why the worker could not, with its exit status."""
    from workers.types import ConfigError, DeviceLost, LoadOnDeviceFailed

    settings = models[0]
    try:
        if host is not None:
            return _serve_host(args, host, models)
        return _serve(args, settings)
    except (ValueError, FileNotFoundError) as exc:  # SettingsError too: a host file reread
        return _fail(str(exc), EXIT_BAD_SETTINGS)
    except ConfigError as exc:  # a missing topic, a refused ACL: an operator must act
        return _fail(str(exc), EXIT_CONFIG)
    except DeviceLost as exc:  # its batches were left unanswered, for another worker
        return _fail(str(exc), EXIT_DEVICE)
    except LoadOnDeviceFailed as exc:  # memory or a device error: another card may load it
        return _fail(str(exc), EXIT_LOAD_DEVICE)
    except ConnectFailed as exc:  # unreachable, or TLS or credentials refused: retrying won't help
        return _fail(str(exc), EXIT_UNREACHABLE)
    except OSError as exc:  # PermissionError, a read-only or full file system, ...
        return _fail(_os_error(exc), EXIT_ENVIRONMENT)


def _serve(args: argparse.Namespace, settings: WorkerSettings) -> int:
    """``conveyor worker`` for one model: its processes' supervisor, or the worker."""
    from workers.fleet.host import child_flags, planned
    from workers.fleet.supervisor import supervise

    slots, cards = ([], []) if settings.processes == "1" else planned(settings)
    if getattr(args, "check", False):
        return _check([(settings, slots)])
    with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
        if len(slots) > 1:  # several processes: this one supervises them
            given = child_flags(_given(args))
            return runner.run(supervise([(settings, slots)], given, cards))
        from workers.app import run_worker  # torch: only a process that serves imports it

        runner.run(run_worker(settings))
    return EXIT_STOPPED


def host_of(args: argparse.Namespace) -> HostFile | None:
    """The host file ``--config-file`` (or ``CONVEYOR_CONFIG_FILE``) names, when it has
    ``[[models]]`` and this process is not one of its models' (``--host-model``)."""
    named = getattr(args, "config_file", None) or os.environ.get("CONVEYOR_CONFIG_FILE")
    if not named or getattr(args, "host_model", None) or os.environ.get("CONVEYOR_HOST_MODEL"):
        return None
    host = read_host_file(Path(named), set(WorkerSettings.model_fields))
    model = getattr(args, "model", None) or os.environ.get("CONVEYOR_MODEL")
    if host is not None and model:
        raise SettingsError(
            f"--model {model} (or CONVEYOR_MODEL) with the host file {named}, which names its "
            "models in [[models]] tables: drop it, or use a config file without them"
        )
    return host


def _serve_host(args: argparse.Namespace, file: HostFile, models: list[WorkerSettings]) -> int:
    """``conveyor worker --config-file HOST.toml``: one supervisor for the file's models."""
    from workers.fleet.host import Host, child_flags, planned
    from workers.fleet.supervisor import supervise

    settings = models[0]
    share = len(models)
    planned_models = []
    cards: dict[int, Card] = {}
    for model in models:
        slots, chosen = planned(model, share=share)
        planned_models.append((model, slots))
        cards.update((card.index, card) for card in chosen)
    if getattr(args, "check", False):
        _check(planned_models)
        print(_reload_of(file, settings.metrics_port))
        return 0
    host = Host(
        Path(args.config_file or os.environ["CONVEYOR_CONFIG_FILE"]),
        file,
        lambda name: settings_from_args(args, host_model=name),
        share,
    )
    given = child_flags(_given(args))
    with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
        return runner.run(supervise(planned_models, given, list(cards.values()), host))


def _check(models: list[tuple[WorkerSettings, list[Slot]]]) -> int:
    """``--check``: the settings are valid; the processes each model would run."""
    for settings, slots in models:
        where = sorted({slot.device for slot in slots}) or ["cpu"]
        stage = settings.next_stage
        then = "" if stage is None else f"; then {stage.model}: {_children(stage)}"
        print(
            f"model {settings.served_name} ({settings.model}): {max(1, len(slots))} "
            f"process{'es' if len(slots) > 1 else ''} on {', '.join(where)}; group "
            f"{settings.group}, requests {settings.topics.requests}{then}"
        )
    print("settings valid")
    return 0


def _reload_of(file: HostFile, port: int) -> str:
    """What SIGHUP would do to the host serving on this machine's ``port``, as its log
    would say it; or that no host answers there."""
    url = f"http://127.0.0.1:{port}{HOST_FILE_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=_ASK_HOST_S) as answer:
            running = json.load(answer)
    except (OSError, ValueError):
        return f"no host answers on 127.0.0.1:{port}: no running host file to compare with"
    return f"SIGHUP to the host on 127.0.0.1:{port} would: {reload_from(running, file).describe()}"


def _children(stage: NextStage) -> str:
    """What a next stage gets of each answer, in words."""
    if stage.whole_image:
        return "the whole image" + ("" if stage.size is None else f" at most {stage.size} px")
    classes = f" of {', '.join(sorted(stage.classes))}" if stage.classes else ""
    return (
        f"up to {stage.max_children} boxes{classes} scoring {stage.min_score:g} or more, "
        f"to {stage.topic}"
    )


_SPEC_EXTRAS = {"timm": ("timm", "timm"), "hf": ("transformers", "hf")}
"""Model spec kinds that need an extra: the module looked up, and the extra's name."""


def _missing_extra(models: Sequence[WorkerSettings]) -> str | None:
    """What the settings need that is not installed, in words, or None."""
    tracing = models[0].tracing
    missing = _missing_for_tracing(tracing)
    if missing is not None:
        return (
            f"--tracing {tracing} needs the tracing extra, which is not installed "
            f"(no module {missing!r}): {install_hint('tracing')}"
        )
    for model in models:
        kind = model.model.partition(":")[0]
        if kind in _SPEC_EXTRAS and not _found(_SPEC_EXTRAS[kind][0]):
            module, extra = _SPEC_EXTRAS[kind]
            return (
                f"--model {model.model} needs the {extra} extra, which is not installed "
                f"(no module {module!r}): {install_hint(extra)}"
            )
    quantized = next((m for m in models if m.quantize != "none"), None)
    if quantized is not None and not _found("torchao"):
        return (
            f"--quantize {quantized.quantize} ({quantized.model}) needs the quant extra, "
            f"which is not installed (no module 'torchao'): {install_hint('quant')}"
        )
    return None


def _missing_for_tracing(tracing: str) -> str | None:
    """The first module that ``--tracing`` needs and cannot find, or None; looked up, not
    imported, before the model loads (``workers.observe.tracing`` imports them)."""
    if tracing == "off":
        return None
    needed = ["opentelemetry.sdk.trace"]
    if tracing == "otlp":
        needed.append("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    return next((name for name in needed if not _found(name)), None)


def _found(module: str) -> bool:
    """Whether ``module`` can be imported; looked up, not imported."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a package above it is missing
        return False


def _os_error(exc: OSError) -> str:
    message = f"{exc.strerror}: {exc.filename}" if exc.filename and exc.strerror else str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        message += f" (the worker runs as uid {os.getuid()})"
    return message


def _fail(message: str, status: int) -> int:
    print(f"conveyor worker: {message}", file=sys.stderr)
    return status


def fields_in_groups() -> Iterator[str]:
    """Every field name FLAG_GROUPS and NESTED place, in help order."""
    for names in FLAG_GROUPS.values():
        yield from names
    yield from NESTED


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.cli``: the worker alone (a host's supervisor starts its processes so)."""
    parser = argparse.ArgumentParser(prog="conveyor worker")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

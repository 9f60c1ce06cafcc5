"""What a host's supervisor settles before any worker process starts (``workers.fleet.supervisor``).

The processes to run (``planned``: cards and counts from ``workers.fleet.plan``), the
request topics' partitions against them and the group's other members
(``check_partitions``), the MPS server (``start_mps``), and each process's command
line and environment (``child``): the user's own flags, with secrets passed as
``CONVEYOR_*`` variables rather than on a command line ``ps`` shows, and the flags
that make it one of many (its card, its name ``<host>-<card>-<n>`` as static group
membership and worker id, a private metrics port, its share of the cores).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from pydantic_settings import SettingsError

from common.security import kafka_connect_failed, kafka_options
from workers.config.host import HostFile, read_host_file
from workers.config.worker import WorkerSettings
from workers.fleet import gpus, plan
from workers.fleet.children import Child
from workers.fleet.mps import MpsServer, MpsUnavailable, running_server
from workers.kafka.topics import check_topics
from workers.types import ConfigError

log = logging.getLogger("conveyor.fleet")

CHILD_MODULE = "workers.cli"
_OVERRIDDEN = frozenset(
    {
        "processes",
        "device",
        "gpus",
        "mps",
        "group_instance_id",
        "worker_id",
        "metrics_host",
        "metrics_port",
        "host_model",
    }
)


class FleetError(ConfigError):
    """The host cannot run the processes asked for; the message says what to change."""


@dataclass
class Host:
    """A host file (``workers.config.host``) its supervisor serves: where it is, what it
    said when last read, and each model's settings and processes as they are planned."""

    path: Path
    file: HostFile
    settings_for: Callable[[str], WorkerSettings]  # a model's, as its processes read them
    models: int  # how many share the cards when each plans its processes

    def read(self) -> HostFile:
        """The file as it is now; raises ``SettingsError`` naming what is wrong."""
        found = read_host_file(self.path, set(WorkerSettings.model_fields))
        if found is None:
            raise SettingsError(f"host file {self.path} has no [[models]] tables any more")
        return found

    def slots_for(self, settings: WorkerSettings) -> list[plan.Slot]:
        return planned(settings, share=self.models)[0]


def planned(settings: WorkerSettings, share: int = 1) -> tuple[list[plan.Slot], list[plan.Card]]:
    """The processes this host would run (before the partition and memory checks), for
    one of ``share`` models of a host file (``auto`` gives each the count one model
    would get, within MPS's clients a card: ``workers.fleet.plan``).
    Raises ValueError for cards that are not there."""
    cards = [] if settings.device == "cpu" else gpus.visible_cards()
    if settings.device.startswith("cuda") and not cards:
        raise ValueError(
            f"device {settings.device}: no GPU is visible here (nvidia-smi lists none, or "
            "CUDA_VISIBLE_DEVICES hides them); use --device cpu, or run on a GPU host"
        )
    chosen = plan.chosen_cards(settings.gpus, settings.device, cards)
    if chosen and settings.decode in ("gpu-hw", "both") and not _has_nvimgcodec():
        raise ValueError(
            f"decode {settings.decode} needs nvImageCodec for the card's hardware JPEG "
            "engine: pip install nvidia-nvimgcodec-cu13 (or decode gpu: nvJPEG alone)"
        )
    cores = len(os.sched_getaffinity(0))
    return plan.slots(plan.parse_processes(settings.processes), chosen, cores, share), chosen


def _has_nvimgcodec() -> bool:
    """Whether nvImageCodec is installed, looked up (``workers.decode.jpeg.HardwareJpeg``
    imports it in the processes; the supervisor imports no torch, which that module does)."""
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except ModuleNotFoundError:  # no "nvidia" package at all
        return False


def child_flags(given: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """The user's own flags (``given``: field -> value as parsed) for every process, and
    the secret ones as ``CONVEYOR_*`` variables (a command line is visible to ``ps``)."""
    flags: list[str] = []
    env: dict[str, str] = {}
    for name, value in given.items():
        if name in _OVERRIDDEN or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if _secret(name):
            env[f"CONVEYOR_{name.upper()}"] = str(value)
        elif isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags, env


def _secret(name: str) -> bool:
    annotation = WorkerSettings.model_fields[name].annotation
    return annotation is not None and "SecretStr" in str(annotation)


async def check_partitions(settings: WorkerSettings, slots: list[plan.Slot]) -> list[plan.Slot]:
    """``slots``, fewer for ``auto`` when the request topics have too few partitions.

    Raises ``FleetError`` for an explicit count they cannot serve, ``TopicProblem``
    (also a ``ConfigError``) for topics missing or forbidden.
    """
    topics = settings.topics
    try:
        facts = await check_topics(settings, topics)
    except (KafkaError, OSError) as exc:
        raise await kafka_connect_failed(settings.kafka_bootstrap, settings, exc) from None
    requests = [topics.lane(lane.name) for lane in settings.request_lanes]
    partitions = sum(facts.partitions[name] for name in requests)
    others = await _other_members(settings)
    room = partitions - others
    if len(slots) <= room:
        return slots
    seen = f" and {others} other members of the group" if others else ""
    advice = (
        f"the request topic{'s' if len(requests) > 1 else ''} {', '.join(requests)} "
        f"{'have' if len(requests) > 1 else 'has'} {partitions} partitions for {len(slots)} "
        f"processes of this host{seen}: a process without a partition is never ready. Add "
        f"partitions (kafka-topics.sh --alter --topic {requests[0]} --partitions "
        f"{len(slots) + others}), or run fewer processes (--processes N)"
    )
    if settings.processes != "auto" or room < 1:
        raise FleetError(advice)
    log.warning("%s; running %d processes", advice, room)
    return slots[:room]


async def _other_members(settings: WorkerSettings) -> int:
    """Members of the model's group that are not this host's processes (best effort: 0
    when the group cannot be described)."""
    group = settings.group
    ours = bases(settings).worker
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=f"{ours}-fleet-admin",
        **kafka_options(settings),
    )
    try:
        await admin.start()
        responses = await admin.describe_consumer_groups([group])
    except (KafkaError, OSError) as exc:  # the count is advice, not a condition to start
        log.info(
            "could not describe group %s (%s): counting this host's processes only", group, exc
        )
        return 0
    finally:
        await admin.close()
    members = [
        member
        for response in responses
        for found in response.to_object()["groups"]
        if found["group"] == group
        for member in found["members"]
    ]
    return sum(1 for m in members if not str(m["client_id"]).startswith(f"{ours}-"))


def start_mps(settings: WorkerSettings, slots: list[plan.Slot]) -> MpsServer | None:
    """An MPS server of the host's own when its cards' processes need one and none runs
    (None otherwise, or when it cannot start under ``--mps auto``: the reason logged).
    Raises ``MpsUnavailable`` when ``--mps on`` cannot have one."""
    on_card = [slot.card for slot in slots if slot.card is not None]
    crowded = any(on_card.count(card) > 1 for card in set(on_card))
    if settings.mps == "off" or not on_card or (settings.mps == "auto" and not crowded):
        return None
    existing = running_server()
    if existing is not None:
        log.info("using the MPS server already running (pipes in %s)", existing)
        return None
    try:
        return MpsServer.start()
    except MpsUnavailable as exc:
        if settings.mps == "on":
            raise
        log.warning(
            "MPS cannot run here (%s): each card's processes take turns on it instead of "
            "overlapping (set --mps off to silence this)",
            exc,
        )
        return None


class Bases(NamedTuple):
    """What the processes' names start with: the settings' own, or the host's name."""

    instance: str
    worker: str


def bases(settings: WorkerSettings) -> Bases:
    host = socket.gethostname()
    worker = settings.worker_id if "worker_id" in settings.model_fields_set else host
    return Bases(settings.group_instance_id or host, worker)


def make_child(
    settings: WorkerSettings,
    flags: Sequence[str],
    slot: plan.Slot,
    cards: Sequence[plan.Card],
    names: Bases,
    threads: int,
    extra_env: dict[str, str],
) -> Child:
    """The process of ``slot``: on a card, bound to it (``card_environment``)."""
    overrides = [
        "--processes", "1",
        "--device", "cpu" if slot.card is None else "cuda:0",
        "--mps", "off",
        "--group-instance-id", slot.name(names.instance),
        "--worker-id", slot.name(names.worker),
        "--metrics-host", "127.0.0.1",
        "--metrics-port", "0",
    ]  # fmt: skip
    if "decode_threads" not in settings.model_fields_set:
        overrides += ["--decode-threads", str(threads)]
    if settings.decode == "both" and slot.card is not None:  # each card's two JPEG decoders
        overrides += ["--decode", "gpu-hw" if slot.number % 2 else "gpu"]
    env = {**extra_env, **card_environment(slot, cards)}
    return Child(
        slot,
        slot.name(names.worker),
        CHILD_MODULE,
        [*flags, *overrides],
        child_environment(threads, env),
        json=settings.log_format == "json",
    )


def card_environment(slot: plan.Slot, cards: Sequence[plan.Card]) -> dict[str, str]:
    """What binds a process to its card: ``CUDA_VISIBLE_DEVICES`` naming that card alone
    (by UUID), so the process sees it as ``cuda:0``.

    A compiled package's code names the device it was compiled on (Inductor's wrapper
    sets ``cuda:0`` current before each launch, and its Triton kernels are loaded into
    that device's context): a process on ``cuda:1`` that loaded the package the first
    process compiled on ``cuda:0`` launched those kernels on its own tensors in another
    card's context, and CUDA refused (``CUDA driver error: invalid argument``). Every
    process seeing its card as ``cuda:0`` makes one package valid on every card.
    """
    if slot.card is None:
        return {}
    card = next(c for c in cards if c.index == slot.card)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if card.uuid:
        name = card.uuid
    elif visible:  # numbered among the visible ones, as CUDA numbers them here
        name = [part.strip() for part in visible.split(",") if part.strip()][card.index]
    else:
        name = str(card.index)
    return {"CUDA_VISIBLE_DEVICES": name}


def child_environment(threads: int, extra_env: dict[str, str]) -> dict[str, str]:
    """A worker process's environment: the supervisor's, ``extra_env``, and each process's
    share of the cores for torch's own threads (unless set): otherwise every process
    starts one a core, and the host's processes load their models at once."""
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def compiles(settings: WorkerSettings) -> bool:
    """Whether the processes may compile their model (``--compile``, on by default on a GPU
    for models of fixed-size images; the supervisor loads no model, so on a GPU it assumes
    one, and a detector's fork server imports Dynamo for nothing)."""
    return settings.compile or (settings.compile is None and settings.device != "cpu")


def preloaded(settings: WorkerSettings) -> list[str]:
    """What the host's fork server imports for its processes: the worker, torch and
    torchvision, and, when the model is compiled, Dynamo and Inductor's cache. Not
    ``torch._inductor.compile_fx`` (nor what imports it): on a GPU host, importing it
    starts a thread of CUDA's driver (``cuda0000…``, seen on H200 hosts with torch 2.11),
    and a process with a second thread must not fork; each process imports it itself."""
    modules = ["workers.app", "torchvision"]
    if compiles(settings):
        modules += ["torch._dynamo", "torch._inductor.codecache"]
    return modules

"""The worker's settings: one frozen object, parsed at the edge (CLI, environment, file).

Every option is a field here and can be set with the matching CLI flag
(``--max-batch-size 64``), a ``CONVEYOR_<FIELD>`` environment variable
(``CONVEYOR_MAX_BATCH_SIZE=64``) or a key of the TOML file named by
``config_file`` (``max_batch_size = 64``), in that order of precedence; defaults
come last. Values are validated when the worker starts, so a bad setting fails
fast with a message naming it.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from common.redis_cluster import check_cluster_url
from common.s3 import S3Settings
from common.security import ConnectionSecurity
from schemas import (
    DEFAULT_LANE,
    DEFAULT_LIMITS,
    Limits,
    ModelTopics,
    Role,
    consumer_group,
    topics_for,
)
from workers.batching.lanes import LaneSpec, checked_lanes, parse_lanes
from workers.config.dataref import DatarefSettings
from workers.config.file import ConfigFileSource
from workers.config.next_stage import NextStage

MODEL_DIR_VARIABLE = "CONVEYOR_MODEL_DIR"
"""Folder of the demo models' artifacts, read by ``demo.models``. Not a field:
the loader takes the artifact's path, and this only moves its default."""

COMPILE_CACHE_WARM_MARK = "warm"
"""A file a worker leaves in its compile cache folder once it has compiled and warmed up
its model: a host's supervisor starts the other processes at once when it is there."""

DEFAULT_METRICS_HOST = "0.0.0.0"  # probes and scrapers come from outside the container
# Not 9400: NVIDIA's dcgm-exporter, found on most GPU nodes, listens there.
DEFAULT_METRICS_PORT = 9406
"""Port of /metrics, /healthz and /readyz unless ``metrics_port`` says otherwise."""

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_COMMIT_ROOM_MS = 5_000  # time kept after a drain for the commit and the rejoin


def _default_worker_id() -> str:
    """HOSTNAME-PID"""
    return f"{socket.gethostname()}-{os.getpid()}"


def _default_decode_threads() -> int:
    """min(8, CPU count)"""
    return min(8, os.cpu_count() or 1)


def _no_lanes() -> tuple[LaneSpec, ...]:
    """none: the plain request topic alone"""
    return ()


class WorkerSettings(BaseSettings, ConnectionSecurity, S3Settings, DatarefSettings):
    """Everything a worker process needs to know, validated once at start."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", frozen=True, extra="forbid", env_nested_delimiter="__"
    )

    # What to serve.
    model: str = Field(
        description="model spec: digits | torchvision:ARCH | embedding:ARCH | timm:NAME | "
        "hf:PATH_OR_ID | torchscript:PATH | export:PATH | module.path:Class (docs/models.md)"
    )
    model_name: str | None = Field(
        default=None, description="name used in topic names (default: derived from --model)"
    )
    weights: str | None = Field(
        default=None,
        description="torchvision and timm models: a weights file, DEFAULT (or a torchvision "
        "weights name: IMAGENET1K_V2) to download the published weights unless cached, or "
        "'random' (benchmarks only); unset: the published weights if cached, never a download",
    )
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto",
        description="auto: on CUDA, float16 for torchvision models and timm's ViTs, "
        "ConvNeXts, EfficientNets and ResNets (docs/models.md, Precision); else float32",
    )
    quantize: Literal["none", "int8"] = Field(
        default="none",
        description="int8: the linear layers of a classifier or embedding model in int8 "
        "through torchao (the quant extra), the other layers in --dtype; gains where linear "
        "layers dominate (ViTs), little for convolutional networks",
    )
    channels_last: bool | None = Field(
        default=None, description="default: on for torchvision models on CUDA"
    )
    model_options: dict[str, Any] = Field(
        default_factory=dict,
        description="JSON object of model options, e.g. '{\"min_size\": 640}': keyword "
        "arguments of torchvision's model builder, of timm.create_model, or of your handler class",
    )
    then: str | None = Field(
        default=None,
        description="a pipeline's next model: the boxes of each answer go to its request "
        "topic as crops, and the answer is written once every crop is answered "
        "(docs/models.md, Pipelines)",
    )
    then_options: dict[str, Any] = Field(
        default_factory=dict,
        description="JSON object saying which boxes go to the next model: min_score, "
        "classes, max_children, margin, params (docs/models.md, Pipelines)",
    )
    task: Literal[
        "auto",
        "text-classification",
        "token-classification",
        "sentence-embedding",
        "object-detection",
        "image-classification",
        "image-text-embedding",
    ] = Field(
        default="auto",
        description="hf: models: what the model answers; auto = from the folder (a "
        "sentence-transformers folder embeds) or the config's architectures "
        "(...ForObjectDetection: object-detection, ...ForImageClassification: "
        "image-classification, CLIPModel/SiglipModel: image-text-embedding)",
    )
    max_length: int | None = Field(
        default=None,
        ge=2,
        le=1_000_000,
        description="hf: models: most tokens of a text, special tokens included (default: "
        "the model's)",
    )
    truncation: Literal["truncate", "refuse"] = Field(
        default="truncate",
        description="hf: models: a text past --max-length is cut there (its result says "
        "truncated: true), or refused with text_too_long",
    )
    preprocess: Literal["auto", "reference", "fast"] = Field(
        default="auto",
        description="how fixed-size image models fit images: reference = the model's own "
        "evaluation transform, torchvision's or timm's (auto for torchvision:, embedding: and "
        "timm:), fast = one resampling pass",
    )
    decode: Literal["auto", "cpu", "gpu", "gpu-hw", "both"] = Field(
        default="auto",
        description="where JPEGs are decoded: cpu (Pillow), gpu (nvJPEG), gpu-hw (the GPU's "
        "hardware JPEG engine via nvImageCodec), both (half of each card's processes gpu, "
        "half gpu-hw: the card's two decoders at once; one process alone: gpu-hw; slower than "
        "gpu on an H200, docs/operations.md); auto = gpu on CUDA",
    )
    compile: bool | None = Field(
        default=None,
        description="torch.compile the model (default: on for CUDA devices, for models of "
        "fixed-size images and text models, the latter with dynamic shapes; detectors, "
        "segmenters and dual encoders run eagerly); the compiled code is cached "
        "in --compile-cache, so the processes of a host and later starts compile once",
    )
    compile_form: Literal["package", "static", "dynamic"] = Field(
        default="package",
        description="with --compile: package = an Inductor package a batch-size bucket, "
        "loaded without tracing (falls back to static for a model torch.export cannot take), "
        "static = torch.compile, one graph a bucket (each traced at every start), dynamic = "
        "torch.compile, one graph with a symbolic batch size (two traces)",
    )
    compile_cache: Path | None = Field(
        default=None,
        description="folder of the compile cache (default: $XDG_CACHE_HOME/conveyor-serve/"
        "compile, else ~/.cache/conveyor-serve/compile); one subfolder per model, weights, "
        "torch version and GPU",
    )
    cuda_graphs: bool | None = Field(
        default=None,
        description="replay the forward as CUDA graphs, one per batch-size bucket, recorded "
        "at start (default: on for CUDA devices; with --compile they record the compiled "
        "forward)",
    )
    cuda_sync: Literal["auto", "spin", "yield", "block"] = Field(
        default="block",
        description="how threads wait for the GPU: block = sleep until it signals, spin = "
        "hold a core, yield = spin but give the core up between checks, auto = CUDA's "
        "choice (spin on machines with more cores than contexts)",
    )
    allow_pickle_models: bool = Field(
        default=False,
        description="allow model files that are unpickled on load (torch.export archives)",
    )

    # Beside the primary workers: a canary or a shadow of another version.
    canary: bool = Field(
        default=False,
        description="serve as the model's canary: consumer group PREFIX.MODEL.canary on the "
        "same request topics, answering the share of requests that the conveyor canary "
        "command gives it while the primary group answers the rest (docs/operations.md)",
    )
    shadow: bool = Field(
        default=False,
        description="serve as a shadow: consumer group PREFIX.MODEL.shadow on the same request "
        "topics, every result to PREFIX.MODEL.shadow-results only, never to Redis, a reply "
        "topic or the dead-letter topic, so callers never see it (conveyor compare reads it)",
    )

    # One host: the processes, their cards, and the tuning they share.
    processes: str = Field(
        default="auto",
        description="worker processes on this host: auto (on CUDA one a CPU core, at most "
        "8 a card, as many as the card's memory holds; on the CPU one) or a number. More "
        "than one runs a supervisor that starts them, merges their metrics, restarts a "
        "crashed one and drains them all on SIGTERM (docs/operations.md)",
    )
    gpus: str = Field(
        default="all", description="cards the processes spread over: all, or indices as 0,1"
    )
    mps: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="run each card's processes under an NVIDIA MPS server, so that their "
        "kernels overlap: auto = when a card has several processes and no MPS server runs "
        "already (the supervisor starts and stops its own); on = fail without one",
    )
    profile: Literal["throughput", "latency"] = Field(
        default="throughput",
        description="the tuning the other defaults follow: throughput fills the card; "
        "latency keeps fewer batches queued in the model stage and closes them sooner "
        "(docs/operations.md lists what each sets)",
    )

    # Batching.
    max_batch_size: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="most requests in one batch (one forward pass); fixed-size image models "
        "and text models on a GPU, and feature-record (tabular:) models, default to 256",
    )
    max_batch_tokens: int = Field(
        default=16_384,
        ge=1,
        le=16_777_216,
        description="text models: a batch closes before its rows × padded length would pass "
        "this (a text longer alone still runs alone); other models: unused",
    )
    max_delay_ms: float = Field(
        default=5.0,
        ge=0,
        le=60_000,
        description="longest the oldest request of a batch waits for the batch to fill "
        "(the latency profile: 2)",
    )
    close_idle_batches: bool = True
    """close a batch at once when nothing else is on its way (every partition fetched to its
    end, nothing fetched waiting): a lone request does not wait max_delay; under a backlog
    batches form as before"""
    stage_batches: int | None = Field(default=None, ge=1)
    """batches in the model stage at once, running ones included (default: 4 on a GPU, 2 on CPU)"""
    stage_partial_batches: int | None = Field(default=None, ge=1)
    """while this many are in the stage, only a full batch may join them (default: 2)"""
    max_in_flight: int = Field(
        default=32_768,
        ge=1,
        description="records fetched but not yet answered, at most; above it, pause. "
        "in_flight_target_ms (the model's time) usually bounds them first; this caps a "
        "model so fast that the time allows more",
    )
    in_flight_target_ms: int = Field(
        default=2_000,
        ge=10,
        description="fetch ahead at most this much model time (measured per item), so that "
        "a revoked partition drains in about this long; never less than two batches",
    )
    max_age_ms: int | None = Field(
        default=None,
        ge=1,
        description="answer 'expired' for requests older than this (record timestamp), if set",
    )
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        default="auto",
        description="auto: uvloop when it is installed (the worker extra has it), else asyncio",
    )
    switch_interval_ms: float = Field(
        default=0.5,
        gt=0,
        le=100,
        description="longest a thread running Python keeps the GIL while another waits for it "
        "(sys.setswitchinterval; Python's default is 5): short keeps the event loop's fetches "
        "and publishes prompt beside the decode and model threads (--profile latency: 0.2)",
    )
    decode_threads: int = Field(default_factory=_default_decode_threads, ge=1, le=256)
    """threads that decode and preprocess payloads on the CPU"""
    lanes: Annotated[tuple[LaneSpec, ...], NoDecode] = Field(
        default_factory=_no_lanes,
        description="priority lanes, highest first, as NAME[:WEIGHT],... (e.g. high:8): lane "
        "NAME reads topic <prefix>.<model>.requests.NAME, and 'default' (weight 1, last unless "
        "listed) the plain request topic. The highest lane with work is served first; while "
        "lanes compete, each gets at least WEIGHT/(sum of weights) of the batches",
    )
    supersede_frames: bool = Field(
        default=False,
        description="freshest-frame mode for requests with ce_stream and no ce_supersede "
        "header: an older frame still waiting when a newer frame of its stream arrives is "
        "answered 'superseded' without running the model",
    )
    delivery: Literal["at-least-once", "exactly-once"] = Field(
        default="at-least-once",
        description="exactly-once: results, dead letters and consumed offsets of each request "
        "partition go in one Kafka transaction per publish, so a read_committed reader of the "
        "reply topic sees each request once (docs/reliability.md)",
    )
    publishes_in_flight: int = Field(
        default=4,
        ge=1,
        le=64,
        description="at-least-once: publish calls in progress at once; while one waits for "
        "the broker's acknowledgements the next writes to Redis (1: one after another; "
        "exactly-once publishes one at a time)",
    )
    transaction_timeout_ms: int = Field(
        default=60_000,
        ge=1_000,
        le=900_000,
        description="exactly-once: the broker aborts a transaction open this long (a worker "
        "that died without a successor), unblocking read_committed readers",
    )
    decode_memory_mb: int = Field(
        default=1024,
        ge=16,
        description="bound on the memory of images being decoded at once, over all decode "
        "threads; a request waits for room, it is never dropped",
    )

    # Where.
    kafka_bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, host:port[,host:port...]"""
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    """redis://, rediss:// (TLS) or unix:// URL; may hold a password, which is never logged"""
    redis_cluster: bool = Field(
        default=False,
        description="redis_url names a node of a Redis Cluster: results are routed by hash slot",
    )
    redis_replica_acks: int = Field(
        default=0,
        ge=0,
        le=16,
        description="Redis Cluster: replicas that must hold a batch's results (WAIT) before "
        "they count as written; 0 trusts the primary alone",
    )
    topic_prefix: str = "conveyor"
    """topics are PREFIX.MODEL.requests, .results and .dlq; the group is PREFIX.MODEL"""
    result_ttl_s: int = Field(default=86_400, ge=1, description="lifetime of a result in Redis")
    # A slow batch must not get the worker thrown out of its group: aiokafka sends
    # heartbeats from a background task, and max.poll.interval bounds the time
    # between two fetches, which backpressure keeps short.
    session_timeout_ms: int = Field(
        default=10_000,
        ge=1_000,
        description="the group evicts a worker whose heartbeats stop for this long",
    )
    max_poll_interval_ms: int = Field(default=300_000, ge=1_000)
    """longest time between two fetches before the group gives this worker's partitions away"""
    # On a rebalance, every member drains and commits its revoked partitions before it
    # rejoins; the broker waits rebalance_timeout_ms for that, so the drain is bounded
    # well inside it (max_drain_ms) and evicted members never turn a join into a storm.
    rebalance_timeout_ms: int = Field(
        default=60_000,
        ge=1_000,
        description="how long the group waits for members to drain and rejoin on a rebalance",
    )
    max_drain_ms: int = Field(
        default=20_000,
        ge=100,
        description="longest wait for a revoked partition's in-flight work before handing "
        "it back uncommitted (must leave rebalance-timeout room to commit), and for the drain "
        "after SIGTERM before the worker stops with the rest uncommitted",
    )
    permanent_error_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="how long a configuration error (missing topic, refused ACL) may keep "
        "results from becoming durable before the worker exits with status 3",
    )
    unready_after_s: float = Field(
        default=5.0,
        gt=0,
        description="/readyz fails once results have not become durable, or a payload "
        "store has failed, for this long",
    )
    group_instance_id: str | None = Field(
        default=None,
        description="static group membership (e.g. the pod name): a restart within the "
        "session timeout takes its partitions back without a rebalance",
    )
    fetch_buffers: bool = True
    """read fetch responses with one copy per frame, into memory kept (kafka.fetch_buffers)"""

    # Cancellation and status (docs/contract.md); payloads by reference: DatarefSettings.
    cancellation: bool = Field(
        default=False,
        description="answer 'cancelled' to requests whose conveyor:cancel:{ID} key exists "
        "when their batch starts in the model stage (one Redis call per batch)",
    )
    track_status: bool = Field(
        default=False,
        description="mark requests running in Redis (conveyor:status:{ID}) when their batch "
        "starts and count attempts in results (one Redis call per batch)",
    )

    worker_id: str = Field(default_factory=_default_worker_id)
    """this worker's name in results, logs and Kafka client ids (e.g. the pod name)"""
    limits: Limits = DEFAULT_LIMITS
    """limits every request is checked against (the contract's by default)"""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """least severe log level written"""
    log_format: Literal["text", "json"] = Field(
        default="text", description="text for people, json (one object per line) for collectors"
    )
    tracing: Literal["off", "otlp", "console"] = Field(
        default="off",
        description="OpenTelemetry spans of each request that carries a traceparent, as "
        "children of it: otlp = to OTEL_EXPORTER_OTLP_ENDPOINT over HTTP, console = JSON on "
        "stdout (needs the tracing extra; docs/operations.md#tracing)",
    )

    # Operations: /metrics, /healthz and /readyz on one HTTP port.
    metrics_host: str = Field(
        default=DEFAULT_METRICS_HOST, description="address of the metrics port"
    )
    metrics_port: int = Field(
        default=DEFAULT_METRICS_PORT,
        ge=0,
        le=65535,
        description="port of /metrics, /healthz and /readyz (0: any free port)",
    )

    @field_validator("model_options", "then_options", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be a JSON object: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"must be a JSON object, not {type(parsed).__name__}")
        return parsed

    # Where the other settings may also come from.
    config_file: Path | None = Field(
        default=None,
        description="TOML file of settings, keys named as the flags with underscores "
        "(max_batch_size = 64, a [limits] table); flags and CONVEYOR_* variables win over it. "
        "With [[models]] tables it describes a host of several models (docs/operations.md)",
    )
    host_model: str | None = Field(
        default=None,
        description="the [[models]] table of the host file (--config-file) this process "
        "serves; the host's supervisor sets it for each of its processes",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: flags (the CLI passes them as keyword arguments), CONVEYOR_*
        # variables, the config file. No .env file or secrets folder is read.
        return (
            init_settings,
            env_settings,
            ConfigFileSource(settings_cls, init_settings, env_settings),
        )

    @field_validator("processes")
    @classmethod
    def _check_processes(cls, value: str) -> str:
        value = value.strip().lower()
        if value == "auto":
            return value
        if not value.isdigit() or not 1 <= int(value) <= 512:
            raise ValueError(f"processes must be auto or a number from 1 to 512, not {value!r}")
        return str(int(value))

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str) -> str:
        value = value.strip().lower()
        parts = [part.strip() for part in value.split(",")]
        if value != "all" and not (parts and all(part.isdigit() for part in parts)):
            raise ValueError(f"gpus must be all or card indices such as 0,1, not {value!r}")
        return value if value == "all" else ",".join(parts)

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {value!r}")
        return value

    @field_validator("lanes", mode="before")
    @classmethod
    def _read_lanes(cls, value: Any) -> Any:
        return parse_lanes(value)

    @field_validator("lanes")
    @classmethod
    def _check_lanes(cls, lanes: tuple[LaneSpec, ...]) -> tuple[LaneSpec, ...]:
        return checked_lanes(lanes)

    @model_validator(mode="after")
    def _check_names(self) -> WorkerSettings:
        topics = topics_for(self.served_name, self.topic_prefix)  # ValueError naming the part
        for lane in self.lanes:
            topics.lane(lane.name)  # ValueError naming a bad lane name
        self.check_redis_url(self.redis_url)
        return self

    @model_validator(mode="after")
    def _check_cluster(self) -> WorkerSettings:
        if self.redis_cluster:
            check_cluster_url(self.redis_url.get_secret_value())
        elif self.redis_replica_acks:
            raise ValueError(
                "redis_replica_acks needs redis_cluster: on a standalone Redis, results are "
                "written without waiting for replicas"
            )
        return self

    @model_validator(mode="after")
    def _check_role(self) -> WorkerSettings:
        if self.canary and self.shadow:
            raise ValueError("a worker is a canary or a shadow, not both: pick one")
        if self.shadow and self.track_status:
            raise ValueError(
                "track_status writes to Redis, which a shadow never does: leave it off "
                "for --shadow workers"
            )
        if self.shadow and self.delivery == "exactly-once":
            raise ValueError(
                "a shadow delivers at least once (its results topic is read by conveyor "
                "compare, which takes each id's first result): leave delivery at "
                "at-least-once for --shadow workers"
            )
        return self

    @model_validator(mode="after")
    def _check_next_stage(self) -> WorkerSettings:
        if self.then is None:
            if self.then_options:
                raise ValueError("then_options says which boxes go to the next model: set then too")
            return self
        NextStage.parse(self.then, self.then_options, self.topic_prefix)  # names what is wrong
        if self.then == self.served_name:
            raise ValueError(f"then names the next model; {self.then!r} is this worker's own")
        return self

    @property
    def next_stage(self) -> NextStage | None:
        """The model this worker's answers feed (``then``), and which boxes it gets."""
        if self.then is None:
            return None
        return NextStage.parse(self.then, self.then_options, self.topic_prefix)

    @model_validator(mode="after")
    def _check_drain(self) -> WorkerSettings:
        if self.max_drain_ms + _COMMIT_ROOM_MS > self.rebalance_timeout_ms:
            raise ValueError(
                f"max_drain_ms ({self.max_drain_ms}) must be at least {_COMMIT_ROOM_MS} ms "
                f"below rebalance_timeout_ms ({self.rebalance_timeout_ms}), so a drained "
                "partition is committed before the group gives up on this worker"
            )
        return self

    @property
    def served_name(self) -> str:
        """The model's name in topic names: --model-name, else the last part of the spec."""
        if self.model_name:
            return self.model_name
        tail = re.split(r"[:/]", self.model)[-1]
        return re.sub(r"\.(pt2?|pth|ts)$", "", tail) or self.model

    @property
    def role(self) -> Role:
        """What this worker is to the model's callers: primary, canary or shadow."""
        return "canary" if self.canary else "shadow" if self.shadow else "primary"

    @property
    def group(self) -> str:
        """The consumer group this worker joins (its role's: ``schemas.consumer_group``)."""
        return consumer_group(self.served_name, self.topic_prefix, self.role)

    @property
    def topics(self) -> ModelTopics:
        """The model's topics as this worker uses them: a shadow's results go to the shadow
        results topic."""
        topics = topics_for(self.served_name, self.topic_prefix)
        return replace(topics, results=topics.shadow_results) if self.shadow else topics

    @property
    def max_delay_s(self) -> float:
        return self.max_delay_ms / 1000.0

    @property
    def request_lanes(self) -> tuple[LaneSpec, ...]:
        """Every lane served, highest first; without ``lanes``, the default lane alone."""
        return self.lanes or (LaneSpec(DEFAULT_LANE, 1),)


def describe_error(exc: ValidationError, model: str | None = None) -> str:
    """What is wrong with the settings, as ``--check`` and a host file's reload say it:
    each field with its flag and variable and what is wrong with it, on one line for one
    field (``model``: the host file's model whose settings they are, its ``[[models]]``
    table over the shared ones)."""
    where = "" if model is None else f" of model {model} ([[models]] table or shared settings)"
    said = []
    for err in exc.errors():
        name = ".".join(str(part) for part in err["loc"]) or "settings"
        flag = "--" + name.replace("_", "-")
        env = "CONVEYOR_" + name.upper().replace(".", "__")
        said.append(f"{name} ({flag} or {env}): {err['msg']}")
    if len(said) == 1:
        return f"invalid worker settings{where}: {said[0]}"
    return "\n  ".join([f"invalid worker settings{where}:", *said])

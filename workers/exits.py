"""Exit statuses of ``conveyor worker``, for supervisors and scripts (docs/settings.md).

Shared by the worker process (``workers.cli``) and the supervisor of a host's processes
(``workers.fleet``), which restarts a process after some and stops the host after others.
"""

from __future__ import annotations

EXIT_STOPPED = 0
EXIT_UNEXPECTED = 1  # Python's own for an uncaught exception: its traceback says what
EXIT_BAD_SETTINGS = 2
EXIT_CONFIG = 3  # topics missing or access refused: retrying does not help
EXIT_UNREACHABLE = 4  # as the client commands' EXIT_UNAVAILABLE
EXIT_NOT_INSTALLED = 5
EXIT_ENVIRONMENT = 6
EXIT_DEVICE = 7  # the model's device failed while serving: restart the worker
EXIT_NO_CARD = 8  # the host's supervisor: no card's processes can start
EXIT_LOAD_DEVICE = 9  # the model did not load on the process's device: memory, a device error

EXIT_STATUSES: dict[int, str] = {
    EXIT_STOPPED: "stopped on SIGTERM or Ctrl-C after draining, for --max-drain-ms at most "
    "(what was left unanswered stays uncommitted, for another worker)",
    EXIT_UNEXPECTED: "an unexpected error, its traceback in the log: the model's code raised "
    "while it warmed up (its first forward) or outside a batch, or a fault of Conveyor's; a "
    "host's supervisor counts it as a failed start (docs/operations.md \"When a card cannot "
    'serve")',
    EXIT_BAD_SETTINGS: "invalid settings, config file, model spec or model file (the model's "
    "own error while it loads, e.g. its class's constructor raised), or more processes than "
    "the cards' memory holds (the log says what one process takes and what is left)",
    EXIT_CONFIG: "the model's topics are missing, or Kafka or Redis refused access (ACLs; "
    "the message names the grant): an operator must act",
    EXIT_UNREACHABLE: "Kafka or Redis unreachable at start, or they refused the TLS "
    "handshake or the credentials",
    EXIT_NOT_INSTALLED: "the worker extra (torch) is not installed: a client-only install; "
    "or --tracing is on without the tracing extra (OpenTelemetry), or --quantize without the "
    "quant extra (torchao)",
    EXIT_ENVIRONMENT: "the operating system refused a file or folder the worker needs "
    "(e.g. a model cache folder it may not write: set CONVEYOR_MODEL_DIR)",
    EXIT_DEVICE: "the model's device failed while serving (a sticky CUDA error, e.g. a fault "
    "of another worker under the same MPS server): restart it; the batches it held went "
    "unanswered, to another worker",
    EXIT_NO_CARD: "a host of several processes: on every card (or on the CPU) the processes "
    "failed at start the same way again and again, so none can serve; the log names the "
    'error once per card (docs/operations.md "When a card cannot serve")',
    EXIT_LOAD_DEVICE: "the model did not load or warm up on the process's device, and not "
    "by its own fault: too little memory (torch.OutOfMemoryError, MemoryError) or a device "
    "(CUDA) error while it loaded; another card, or a start with more memory free, may load "
    "it. A host's supervisor counts it as a failed start of that card",
}

PERMANENT = frozenset({EXIT_BAD_SETTINGS, EXIT_CONFIG, EXIT_NOT_INSTALLED, EXIT_ENVIRONMENT})
"""Statuses that starting the process again cannot change: an operator must act."""

"""docs/settings.md, generated from the settings and the help sections of ``conveyor worker``.

``make settings-doc`` writes it; ``tests/unit/test_worker_cli.py`` fails when the
committed page differs from what this module makes of the code, so the page
cannot drift from the flags, variables and defaults the worker has.
"""

from __future__ import annotations

from pydantic.fields import FieldInfo

from workers.cli import (
    ENVIRONMENT_ONLY,
    EXPERT,
    FLAG_GROUPS,
    NESTED,
    PRECEDENCE,
    REQUIRED,
    default_text,
    describe,
    env_name,
)
from workers.config.worker import WorkerSettings
from workers.exits import EXIT_STATUSES


def settings_reference() -> str:
    """docs/settings.md: every setting of ``conveyor worker``, generated from WorkerSettings."""
    fields = WorkerSettings.model_fields
    out = [
        "# Worker settings",
        "",
        "<!-- Generated from workers/config/worker.py by `make settings-doc`; "
        "tests/unit/test_worker_cli.py fails when this file is stale. -->",
        "",
        _md(PRECEDENCE),
        "",
        "Settings marked *expert* are tuning that the profiles (`--profile`) and the "
        "defaults take care of: `conveyor worker --help` leaves them out, `--help-all` "
        "lists them.",
        "",
    ]
    for title, names in FLAG_GROUPS.items():
        out += [f"## {title}", "", "| flag | variable | default | meaning |", "|---|---|---|---|"]
        for name in names:
            info = fields[name]
            flag = "--" + name.replace("_", "-")
            if info.annotation in (bool, bool | None):
                flag += f"`, `--no-{name.replace('_', '-')}"
            cells = (
                f"`{flag}`",
                f"`{env_name(name)}`",
                _md_default(info),
                _md(describe(name, info)) + (" *(expert)*" if name in EXPERT else ""),
            )
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    for name, model in NESTED.items():
        out += [
            f"## {name}",
            "",
            f"No flags: set with these variables or as keys of a `[{name}]` table in the "
            "config file.",
            "",
            "| variable | key | default | meaning |",
            "|---|---|---|---|",
        ]
        for field, info in model.model_fields.items():
            cells = (
                f"`{env_name(name)}__{field.upper()}`",
                f"`{field}`",
                _md_default(info),
                _md(describe(field, info)),
            )
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Other variables", "", "| variable | meaning |", "|---|---|"]
    out += [f"| `{variable}` | {_md(meaning)} |" for variable, meaning in ENVIRONMENT_ONLY.items()]
    out += ["", "## Exit status of `conveyor worker`", "", "| status | meaning |", "|---|---|"]
    out += [f"| {code} | {_md(meaning)} |" for code, meaning in EXIT_STATUSES.items()]
    out += ["", "## A config file", "", "```toml", *EXAMPLE_CONFIG, "```", ""]
    return "\n".join(out)


EXAMPLE_CONFIG = (
    "# conveyor worker --config-file worker.toml",
    'model = "torchvision:resnet50"',
    'weights = "/models/resnet50.pth"',
    'device = "cuda"',
    "max_batch_size = 64",
    'kafka_bootstrap = "kafka-1.internal:9092"',
    'log_format = "json"',
    "",
    "[limits]",
    "max_payload_bytes = 4194304",
)


def _md(text: str) -> str:
    """Description text in a Markdown table cell: reST literals as code, pipes escaped."""
    return text.replace("``", "`").replace("|", "\\|")


def _md_default(info: FieldInfo) -> str:
    default = default_text(info)
    if default in ("", REQUIRED):
        return default or "none"
    return f"`{default}`" if info.default_factory is None else default

"""The distribution's name on PyPI, and the pip command that adds an optional part.

The name (``conveyor-serve``) differs from the command (``conveyor``) and from the
import packages, so every hint that tells a user what to install is built here.
"""

from __future__ import annotations

DISTRIBUTION = "conveyor-serve"
"""The name to ``pip install`` (other projects already use ``conveyor``)."""


def install_hint(extra: str) -> str:
    """``pip install 'conveyor-serve[EXTRA]'``: the command that adds an optional part."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"

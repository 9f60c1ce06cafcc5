"""Where a benchmark's broker and Redis are, and the one wait it times.

Topics, backlogs, paced load and reading results are ``producers.testing``'s, as
the tests use them; nothing here times anything but ``all_results_in``, and
``bench.cpu`` decides what a measurement spans.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import SecretStr

from producers.settings import ClientSettings
from producers.testing import await_results

_POLL_S = 0.01  # how often the last result of each partition is looked for


@dataclass(frozen=True)
class Services:
    """Where the broker and Redis are."""

    kafka_bootstrap: str
    redis_url: str

    def client_settings(self) -> ClientSettings:
        return ClientSettings(
            kafka_bootstrap=self.kafka_bootstrap, redis_url=SecretStr(self.redis_url)
        )


async def all_results_in(
    services: Services, ids: Sequence[str], last_ids: Sequence[str], timeout_s: float
) -> float:
    """Wait until every id has a result in Redis; returns the wall time (epoch s) it was seen.

    Only ``last_ids`` (the last request of each partition) are polled, every
    10 ms, so the poller stays cheap; a worker answers a partition in order, so
    once those are in, the rest should be too, which one full check confirms.
    Raises ``TimeoutError`` if some are still missing after ``timeout_s``.
    """
    missing = await await_results(
        services.redis_url, ids, timeout_s, watch=last_ids, poll_s=_POLL_S
    )
    seen_at = time.time()
    if missing:
        raise TimeoutError(f"{len(missing)} of {len(ids)} results missing after {timeout_s} s")
    return seen_at

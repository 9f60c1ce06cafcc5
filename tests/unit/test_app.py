"""The worker process's own set-up around the pipeline (workers/app.py)."""

from __future__ import annotations

import gc

from workers.app import start_up_objects_frozen


def test_start_up_objects_leave_the_collector_while_serving_and_return_after() -> None:
    made_at_start_up = [object() for _ in range(10)]  # a stand-in for the model
    assert gc.get_freeze_count() == 0
    with start_up_objects_frozen():
        assert gc.get_freeze_count() >= len(made_at_start_up)
        assert gc.collect() >= 0  # collections still run, over what serving makes
    assert gc.get_freeze_count() == 0


def test_an_error_while_serving_still_unfreezes() -> None:
    try:
        with start_up_objects_frozen():
            raise RuntimeError("model crashed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0

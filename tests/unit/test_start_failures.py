"""The rules that stop a host from starting, forever, processes that cannot serve
(``workers.fleet.failing``); tests/integration/test_fleet.py runs them in a supervisor."""

from __future__ import annotations

from workers.fleet.failing import StartFailures, error_line

DRIVER = "RuntimeError: CUDA driver error: invalid argument"


def two_cards(per_card: int) -> StartFailures:
    return StartFailures(
        {f"GPU {card}": [f"h-{card}-{n}" for n in range(per_card)] for card in (0, 1)}
    )


def test_a_card_whose_processes_all_fail_alike_is_retired_at_once() -> None:
    failures = two_cards(8)
    for n in range(7):
        assert failures.failed(f"h-1-{n}", DRIVER) == []
    retired = failures.failed("h-1-7", DRIVER)
    assert retired == [f"h-1-{n}" for n in range(8)]
    assert failures.failed_cards() == {"GPU 1": DRIVER}
    assert failures.serving_cards() == ["GPU 0"]
    assert not failures.none_serve
    assert failures.failed("h-1-0", DRIVER) == []  # retired: no longer counted


def test_a_process_failing_alike_three_times_is_retired_alone() -> None:
    failures = two_cards(8)
    assert failures.failed("h-0-3", DRIVER) == []
    assert failures.failed("h-0-3", DRIVER) == []
    assert failures.failed("h-0-3", DRIVER) == ["h-0-3"]
    assert failures.failed_cards() == {}  # its card's other processes serve
    assert failures.serving_cards() == ["GPU 0", "GPU 1"]


def test_other_errors_or_a_start_that_served_begin_the_count_again() -> None:
    failures = two_cards(2)
    failures.failed("h-0-0", DRIVER)
    failures.failed("h-0-0", "MemoryError")  # another way: a new streak
    failures.failed("h-0-0", DRIVER)
    assert failures.retired == {}
    failures.failed("h-0-0", DRIVER)
    failures.served("h-0-0")  # it reached ready in between
    failures.failed("h-0-0", DRIVER)
    failures.failed("h-0-0", DRIVER)
    assert failures.retired == {}
    assert failures.failed("h-0-0", DRIVER) == ["h-0-0"]


def test_one_failure_of_a_lone_process_is_not_its_cards_verdict() -> None:
    """A card with one process needs as many failed starts as any process."""
    failures = two_cards(1)
    assert failures.failed("h-1-0", DRIVER) == []
    assert failures.failed("h-1-0", DRIVER) == []
    assert failures.failed("h-1-0", DRIVER) == ["h-1-0"]
    assert failures.failed_cards() == {"GPU 1": DRIVER}


def test_a_host_whose_cards_have_all_failed_cannot_serve() -> None:
    failures = two_cards(4)
    for card in (0, 1):
        for n in range(4):
            failures.failed(f"h-{card}-{n}", DRIVER)
    assert failures.serving_cards() == []
    assert failures.none_serve


def test_the_error_is_the_last_line_that_names_one() -> None:
    traceback = [
        "Traceback (most recent call last):",
        '  File "static_triton_launcher.py", line 9, in _launch_kernel',
        DRIVER,
        "\n",
    ]
    assert error_line(traceback) == DRIVER
    assert error_line(["conveyor worker: no GPU 3 on this host", "bye"]) == (
        "conveyor worker: no GPU 3 on this host"
    )
    assert error_line(["starting", "loading"]) == "loading"
    assert error_line([]) == "no output"
    assert len(error_line(["ValueError: " + "x" * 1000])) == 300

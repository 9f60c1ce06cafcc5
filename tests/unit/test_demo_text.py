"""The text demo's verdict: it passes only when every review is answered with the label
the model gives offline; accuracy counts an unanswered review as wrong."""

from __future__ import annotations

from demo.models.reviews import Reviews
from demo.text import _report
from schemas import Result
from schemas.result import ok_result

DATA = Reviews(["It is great.", "It is not great.", "The lid is bad."], ["positive"] * 3)
OFFLINE = [("positive", 0.9), ("negative", 0.8), ("negative", 0.7)]


def answer(n: int, label: str, score: float) -> Result:
    outputs = {
        "type": "conveyor.text_classification.v1",
        "labels": [{"label": label, "index": 0, "score": score}],
        "truncated": False,
    }
    return ok_result(f"r-{n}", outputs, model="m", model_version="v", worker="w")


def test_every_label_as_offline_passes() -> None:
    report = _report("m", [answer(n, *OFFLINE[n]) for n in range(3)], DATA, OFFLINE)
    assert report.passed
    assert (report.answered, report.agreeing) == (3, 3)
    assert report.accuracy == report.offline_accuracy == 1 / 3
    assert report.largest_difference == 0.0


def test_one_label_differing_fails() -> None:
    served = [answer(0, "positive", 0.9), answer(1, "positive", 0.6), answer(2, "negative", 0.7)]
    report = _report("m", served, DATA, OFFLINE)
    assert not report.passed
    assert report.agreeing == 2
    assert report.accuracy == 2 / 3
    assert abs(report.largest_difference - 0.2) < 1e-9


def test_an_unanswered_review_fails_and_counts_wrong() -> None:
    report = _report("m", [answer(0, "positive", 0.9), None, None], DATA, OFFLINE)
    assert not report.passed
    assert (report.answered, report.agreeing) == (1, 1)
    assert report.accuracy == 1 / 3

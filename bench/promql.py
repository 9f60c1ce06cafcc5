"""The part of PromQL the dashboard uses, evaluated over scraped samples instead of Prometheus.

``parse`` reads an expression into a small tree; ``metric_names`` lists the
metrics it selects (what tests/integration/test_dashboard_metrics.py checks
against a real worker's ``/metrics``); ``evaluate`` computes it at one scrape
of a ``Scrapes`` history (what bench.dashboard plots). Supported: selectors
with ``= != =~ !~`` matchers, ``rate(...[range])``, ``histogram_quantile``,
``sum``/``max``/``min``/``avg`` with ``by (...)``, and ``+ - * /`` between
vectors with the same labels or a vector and a number. Where this differs from
Prometheus: ``rate`` is the increase from the first to the last sample in the
range divided by the time between them (counter resets handled), without
Prometheus' extrapolation to the range's ends.
"""

from __future__ import annotations

import itertools
import math
import re
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]
Sample = tuple[Labels, float]

_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?)(?![\w.])|(?P<duration>\d+[smhd])|(?P<name>[A-Za-z_:][\w:]*)"
    r'|(?P<string>"(?:[^"\\]|\\.)*")|(?P<op>=~|!~|!=|[=(){}\[\],/*+-]))'
)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": max,
    "min": min,
    "avg": lambda values: sum(values) / len(values),
}
_BINARY: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b if b else math.nan,
}


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...] = ()  # (label, op, value)
    range_s: float | None = None

    def matches(self, labels: Mapping[str, str]) -> bool:
        for label, op, value in self.matchers:
            seen = labels.get(label, "")
            if op in ("=~", "!~"):
                found = re.fullmatch(value, seen) is not None
                if found != (op == "=~"):
                    return False
            elif (seen == value) != (op == "="):
                return False
        return True


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Aggregation:
    op: str
    by: tuple[str, ...] | None  # None: over everything
    expr: Expr


@dataclass(frozen=True)
class Binary:
    op: str
    left: Expr
    right: Expr


Expr = Selector | Number | Call | Aggregation | Binary


@dataclass
class Scrapes:
    """Samples of one ``/metrics`` endpoint, scraped again and again: ``add`` them in time order."""

    times: list[float] = field(default_factory=list)
    samples: list[dict[str, list[Sample]]] = field(default_factory=list)  # by metric name

    def add(self, time_s: float, samples: Sequence[tuple[str, Mapping[str, str], float]]) -> None:
        by_name: dict[str, list[Sample]] = {}
        for name, labels, value in samples:
            by_name.setdefault(name, []).append((frozenset(labels.items()), value))
        self.times.append(time_s)
        self.samples.append(by_name)


def parse(text: str) -> Expr:
    """The expression tree of ``text``; ValueError for what this subset does not read."""
    parser = _Parser(text)
    expr = parser.expression()
    parser.expect(None)
    return expr


def metric_names(expr: Expr) -> set[str]:
    """The names of the metrics ``expr`` selects."""
    if isinstance(expr, Selector):
        return {expr.name}
    if isinstance(expr, Call):
        return set().union(*(metric_names(arg) for arg in expr.args))
    if isinstance(expr, Aggregation):
        return metric_names(expr.expr)
    if isinstance(expr, Binary):
        return metric_names(expr.left) | metric_names(expr.right)
    return set()


def evaluate(expr: Expr, scrapes: Scrapes, at: int) -> Vector | float:
    """``expr`` at scrape number ``at``: a vector (series labels to value) or a number."""
    if isinstance(expr, Number):
        return expr.value
    if isinstance(expr, Selector):
        if expr.range_s is not None:
            raise ValueError(f"a range selector needs a function around it: {expr.name}")
        return {
            labels: value
            for labels, value in scrapes.samples[at].get(expr.name, [])
            if expr.matches(dict(labels))
        }
    if isinstance(expr, Call):
        return _call(expr, scrapes, at)
    if isinstance(expr, Aggregation):
        return _aggregate(expr, _vector(evaluate(expr.expr, scrapes, at)))
    return _binary(expr.op, evaluate(expr.left, scrapes, at), evaluate(expr.right, scrapes, at))


def _vector(value: Vector | float) -> Vector:
    if isinstance(value, float):
        raise ValueError("expected a vector, got a number")
    return value


def _call(expr: Call, scrapes: Scrapes, at: int) -> Vector:
    if expr.function == "rate":
        (selector,) = expr.args
        if not isinstance(selector, Selector) or selector.range_s is None:
            raise ValueError("rate() takes a range selector, e.g. rate(m[1m])")
        return _rate(selector, scrapes, at)
    if expr.function == "histogram_quantile":
        quantile, inner = expr.args
        if not isinstance(quantile, Number):
            raise ValueError("histogram_quantile() takes a number first")
        return _quantiles(quantile.value, _vector(evaluate(inner, scrapes, at)))
    raise ValueError(f"function {expr.function}() is not supported")


def _rate(selector: Selector, scrapes: Scrapes, at: int) -> Vector:
    assert selector.range_s is not None
    end = scrapes.times[at]
    first = bisect_right(scrapes.times, end - selector.range_s)
    points: dict[Labels, list[tuple[float, float]]] = {}
    for i in range(first, at + 1):
        for labels, value in scrapes.samples[i].get(selector.name, []):
            if selector.matches(dict(labels)):
                points.setdefault(labels, []).append((scrapes.times[i], value))
    rates = {}
    for labels, series in points.items():
        if len(series) < 2:
            continue
        increase = 0.0
        for (_, before), (_, after) in itertools.pairwise(series):
            increase += after - before if after >= before else after  # a reset starts at 0
        rates[labels] = increase / (series[-1][0] - series[0][0])
    return rates


def _quantiles(q: float, buckets: Vector) -> Vector:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        le = dict(labels).get("le")
        if le is None:
            continue
        rest = frozenset(item for item in labels if item[0] != "le")
        groups.setdefault(rest, []).append((float(le), count))
    out = {}
    for labels, series in groups.items():
        series.sort()
        total = series[-1][1]
        if total <= 0 or not math.isinf(series[-1][0]):
            continue
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, cumulative in series:
            if cumulative >= rank:
                if math.isinf(bound):
                    out[labels] = lower  # the highest finite bound, as Prometheus answers
                else:
                    share = (rank - below) / (cumulative - below) if cumulative > below else 1
                    out[labels] = lower + (bound - lower) * share
                break
            lower, below = bound, cumulative
    return out


def _aggregate(expr: Aggregation, vector: Vector) -> Vector:
    groups: dict[Labels, list[float]] = {}
    for labels, value in vector.items():
        key = frozenset(item for item in labels if expr.by is not None and item[0] in expr.by)
        groups.setdefault(key, []).append(value)
    combine = _AGGREGATIONS[expr.op]
    return {labels: float(combine(values)) for labels, values in groups.items()}


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    apply = _BINARY[op]
    if isinstance(left, float) and isinstance(right, float):
        return apply(left, right)
    if isinstance(left, float):
        return {labels: apply(left, value) for labels, value in _vector(right).items()}
    if isinstance(right, float):
        return {labels: apply(value, right) for labels, value in left.items()}
    return {
        labels: apply(value, right[labels]) for labels, value in left.items() if labels in right
    }


class _Parser:
    """Recursive descent over the tokens of one expression."""

    def __init__(self, text: str) -> None:
        self._tokens = list(self._tokenize(text))
        self._at = 0

    @staticmethod
    def _tokenize(text: str) -> Iterator[tuple[str, str]]:
        position = 0
        while position < len(text.rstrip()):
            match = _TOKEN.match(text, position)
            if match is None or match.lastgroup is None:
                raise ValueError(f"cannot read {text[position:]!r} in {text!r}")
            yield match.lastgroup, match.group(match.lastgroup)
            position = match.end()

    def peek(self) -> str | None:
        return self._tokens[self._at][1] if self._at < len(self._tokens) else None

    def take(self) -> tuple[str, str]:
        if self._at >= len(self._tokens):
            raise ValueError("the expression ends too early")
        self._at += 1
        return self._tokens[self._at - 1]

    def expect(self, token: str | None) -> None:
        if self.peek() != token:
            raise ValueError(f"expected {token!r}, found {self.peek()!r}")
        if token is not None:
            self._at += 1

    def expression(self) -> Expr:
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            left = Binary(op, left, self.term())
        return left

    def term(self) -> Expr:
        left = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()[1]
            left = Binary(op, left, self.factor())
        return left

    def factor(self) -> Expr:
        kind, token = self.take()
        if kind == "number":
            return Number(float(token))
        if token == "(":
            inner = self.expression()
            self.expect(")")
            return inner
        if kind != "name":
            raise ValueError(f"unexpected {token!r}")
        if token in _AGGREGATIONS and self.peek() in ("(", "by"):
            return self.aggregation(token)
        if self.peek() == "(":
            return self.call(token)
        return self.selector(token)

    def aggregation(self, op: str) -> Aggregation:
        by = self.grouping() if self.peek() == "by" else None
        self.expect("(")
        inner = self.expression()
        self.expect(")")
        if by is None and self.peek() == "by":
            by = self.grouping()
        return Aggregation(op, by, inner)

    def grouping(self) -> tuple[str, ...]:
        self.expect("by")
        self.expect("(")
        labels = []
        while self.peek() != ")":
            labels.append(self.take()[1])
            if self.peek() == ",":
                self.take()
        self.expect(")")
        return tuple(labels)

    def call(self, function: str) -> Call:
        self.expect("(")
        args = [self.expression()]
        while self.peek() == ",":
            self.take()
            args.append(self.expression())
        self.expect(")")
        return Call(function, tuple(args))

    def selector(self, name: str) -> Selector:
        matchers = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label = self.take()[1]
                op = self.take()[1]
                kind, value = self.take()
                if op not in ("=", "!=", "=~", "!~") or kind != "string":
                    raise ValueError(f"bad matcher {label}{op}{value}")
                matchers.append((label, op, value[1:-1].replace('\\"', '"')))
                if self.peek() == ",":
                    self.take()
            self.expect("}")
        range_s = None
        if self.peek() == "[":
            self.take()
            kind, duration = self.take()
            if kind != "duration":
                raise ValueError(f"bad range {duration!r}")
            range_s = float(int(duration[:-1]) * _SECONDS[duration[-1]])
            self.expect("]")
        return Selector(name, tuple(matchers), range_s)

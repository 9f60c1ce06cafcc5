"""Feature schemas: what a tabular model's input is, declared once, and the check of records.

A schema file (TOML, or JSON of the same shape) names each feature in the order of the
model's input columns, with its type and its default::

    name = "fraud"                      # optional, reported in the model version
    classes = ["legit", "fraud"]        # optional: labels of the model's output columns

    [[features]]
    name = "amount"
    type = "float"                      # float | int | boolean | category
                                        # no default: the feature is required

    [[features]]
    name = "merchant_category"
    type = "category"
    values = ["grocery", "travel", "online"]
    default = "grocery"                 # used when the record leaves it out (or sends null)

Encoding, one input column per feature: a float or an int as its value, a boolean as
0 or 1, a category as the index of its value in ``values`` (0, 1, ...; an index, not a
one-hot: tree ensembles split on it directly and a network can embed it). A value
outside ``values`` is refused, never mapped to a default.

``FeatureSchema`` (pydantic) checks a schema file's text once; the worker's check of
records against it is ``workers.handlers.features`` (NumPy). Every refusal is a
``ContractError(bad_feature)`` whose field names the feature (``features.amount``)
and whose message says what to send instead; no missing or ill-typed value ever
becomes a zero. Pure: no I/O, so the client-only install can validate a schema too.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.errors import ContractError, ErrorCode

FeatureType = Literal["float", "int", "boolean", "category"]

MAX_ROWS = 4096
"""Rows a columnar request may carry: enough for a page of candidates to rank, small
enough that one request never holds a batch up for long."""

_NUMBER = (int, float)


class Feature(BaseModel):
    """One input column of the model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    type: FeatureType
    values: tuple[str, ...] | None = None
    """A category's values, in the order of their indices."""
    default: float | int | bool | str | None = None
    """The value used when a record leaves the feature out; ``None``: required."""

    @model_validator(mode="after")
    def _consistent(self) -> Feature:
        if (self.type == "category") != (self.values is not None):
            raise ValueError(f"{self.name}: values are given for a category, and only for one")
        if self.values is not None and len(set(self.values)) != len(self.values):
            raise ValueError(f"{self.name}: a category's values must differ")
        if self.default is not None:
            encode_value(self, self.default)  # raises for a default of the wrong type
        return self

    @property
    def required(self) -> bool:
        return self.default is None


class FeatureSchema(BaseModel):
    """A model's features in input order, and the labels of its output columns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "features"
    classes: tuple[str, ...] | None = None
    features: tuple[Feature, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> FeatureSchema:
        names = [f.name for f in self.features]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"features named twice: {', '.join(twice)}")
        return self

    @classmethod
    def parse(cls, text: str, *, json_text: bool = False) -> FeatureSchema:
        """A schema from a TOML (or, with ``json_text``, JSON) file's text; ``ValueError``
        (pydantic's, or the parser's) saying what is wrong."""
        return cls.model_validate(json.loads(text) if json_text else tomllib.loads(text))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)


def encode_value(feature: Feature, value: object) -> float:
    """One value as its input column holds it; ``ContractError(bad_feature)`` if ill-typed."""
    kind = feature.type
    if kind == "category":
        assert feature.values is not None
        if isinstance(value, str) and value in feature.values:
            return float(feature.values.index(value))
        raise refuse(feature.name, f"must be one of {listed(feature.values)}", value)
    if kind == "boolean":
        if isinstance(value, bool):
            return float(value)
        raise refuse(feature.name, "must be true or false", value)
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        raise refuse(feature.name, f"must be a number ({kind})", value)
    number = float(value)
    if not math.isfinite(number):
        raise refuse(feature.name, "must be a finite number", value)
    if kind == "int" and not number.is_integer():
        raise refuse(feature.name, "must be a whole number (int)", value)
    return number


def refuse(name: str, message: str, seen: object) -> ContractError:
    return ContractError(ErrorCode.bad_feature, f"features.{name}"[:160], message, seen=seen)


def listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:20])
    return shown if len(names) <= 20 else f"{shown}, … ({len(names)} in all)"

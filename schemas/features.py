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

``FeatureSchema`` (pydantic) reads and checks the file once; ``FeatureCheck`` holds
plain lookup tables built from it, and turns records into float32 rows without
pydantic: one record (``{"features": {...}}``) in a loop over its keys, many
(``{"columns": {...}}``) a column at a time with NumPy. Every refusal is a
``ContractError(bad_feature)`` whose field names the feature (``features.amount``)
and whose message says what to send instead; no missing or ill-typed value ever
becomes a zero.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
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
    def load(cls, path: Path) -> FeatureSchema:
        """Read a ``.toml`` or ``.json`` schema file (``ValueError`` saying what is wrong)."""
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        return cls.model_validate(data)

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
        raise _refuse(feature.name, f"must be one of {_list(feature.values)}", value)
    if kind == "boolean":
        if isinstance(value, bool):
            return float(value)
        raise _refuse(feature.name, "must be true or false", value)
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        raise _refuse(feature.name, f"must be a number ({kind})", value)
    number = float(value)
    if not math.isfinite(number):
        raise _refuse(feature.name, "must be a finite number", value)
    if kind == "int" and not number.is_integer():
        raise _refuse(feature.name, "must be a whole number (int)", value)
    return number


class FeatureCheck:
    """Records to float32 rows in the schema's order, every feature checked.

    Built once per model from a ``FeatureSchema``; thread-safe (it only reads its tables).
    """

    def __init__(self, schema: FeatureSchema, *, max_rows: int = MAX_ROWS) -> None:
        self.schema = schema
        self.width = len(schema.features)
        self.max_rows = max_rows
        self._features = schema.features
        self._column = {f.name: i for i, f in enumerate(schema.features)}
        self._required = tuple(f.name for f in schema.features if f.required)
        self._defaults = np.array(
            [0.0 if f.required else encode_value(f, f.default) for f in schema.features],
            dtype=np.float32,
        )
        self._codes = {
            i: {v: float(n) for n, v in enumerate(f.values)}
            for i, f in enumerate(schema.features)
            if f.values is not None
        }

    def defaults(self) -> npt.NDArray[np.float32]:
        """A (F,) row of the defaults, 0 for required features (for warm-up batches)."""
        return self._defaults.copy()

    def record(self, features: object) -> npt.NDArray[np.float32]:
        """One record ``{"name": value, ...}`` as a (F,) row."""
        if not isinstance(features, dict):
            raise ContractError(
                ErrorCode.bad_feature, "features", "must be an object of feature: value"
            )
        row = self._defaults.copy()
        column = self._column
        given = 0
        for name, value in features.items():
            index = column.get(name)
            if index is None:
                raise self._unknown(name)
            if value is None:
                continue  # null is missing: its default, or refused below if required
            row[index] = encode_value(self._features[index], value)
            given += 1
        if given < self.width:
            for name in self._required:
                if features.get(name) is None:
                    raise self._missing(name, None)
        return row

    def columns(self, columns: object) -> npt.NDArray[np.float32]:
        """Columns ``{"name": [v0, v1, ...], ...}`` of equal length as (R, F) rows."""
        if not isinstance(columns, dict) or not columns:
            raise ContractError(
                ErrorCode.bad_feature, "columns", "must be an object of feature: [values]"
            )
        rows = self._length(columns)
        out = np.empty((rows, self.width), dtype=np.float32)
        out[:] = self._defaults
        for name, values in columns.items():
            index = self._column.get(name)
            if index is None:
                raise self._unknown(name)
            out[:, index] = self._column_values(index, values)
        for name in self._required:
            if name not in columns:
                raise self._missing(name, None)
        return out

    def rows(self, array: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """An ``.npy`` array of rows already in feature order: (F,) or (R, F), float."""
        if array.dtype.kind != "f":
            raise ContractError(
                ErrorCode.bad_feature,
                "value",
                "expected float rows (float32 or float64) in the schema's feature order",
                seen=str(array.dtype),
            )
        if array.ndim not in (1, 2) or array.shape[-1] != self.width or array.size == 0:
            raise ContractError(
                ErrorCode.bad_feature,
                "value",
                f"expected shape ({self.width},) or (rows, {self.width}): one column per "
                f"feature, in order: {_list(self.schema.names)}",
                seen=str(array.shape),
            )
        rows = array.reshape(-1, self.width)
        if len(rows) > self.max_rows:
            raise ContractError(
                ErrorCode.bad_feature, "value", "too many rows", limit=self.max_rows, seen=len(rows)
            )
        finite = np.isfinite(rows)
        if not finite.all():
            column = int(np.flatnonzero(~finite.all(axis=0))[0])
            raise _refuse(self.schema.names[column], "must be a finite number", "NaN or inf")
        checked = rows.astype(np.float32)
        self._check_encoded(checked)
        return checked.reshape(array.shape)

    def _check_encoded(self, rows: npt.NDArray[np.float32]) -> None:
        """Rows given as numbers: whole numbers where the type says so, codes in range."""
        for index, feature in enumerate(self._features):
            if feature.type == "float":
                continue
            values = rows[:, index]
            top = len(feature.values) - 1 if feature.values is not None else None
            bad = values != np.round(values)
            if feature.type == "boolean":
                bad |= (values < 0) | (values > 1)
            elif top is not None:
                bad |= (values < 0) | (values > top)
            if bad.any():
                kind = (
                    f"a code 0..{top} of {_list(feature.values or ())}"
                    if top is not None
                    else ("0 or 1" if feature.type == "boolean" else "a whole number")
                )
                raise _refuse(feature.name, f"must be {kind}", float(values[bad][0]))

    def _length(self, columns: Mapping[str, object]) -> int:
        lengths = {len(v) if isinstance(v, list) else -1 for v in columns.values()}
        if -1 in lengths:
            name = next(n for n, v in columns.items() if not isinstance(v, list))
            raise _refuse(name, "a column must be a list of values", columns[name])
        if len(lengths) != 1:
            raise ContractError(
                ErrorCode.bad_feature,
                "columns",
                "every column must have the same number of rows",
                seen=sorted(lengths),
            )
        rows = lengths.pop()
        if rows == 0 or rows > self.max_rows:
            raise ContractError(
                ErrorCode.bad_feature,
                "columns",
                f"a request carries 1 to {self.max_rows} rows",
                seen=rows,
            )
        return rows

    def _column_values(self, index: int, values: list[Any]) -> npt.NDArray[np.float32]:
        """One column checked as a whole: its element types first, then its values."""
        feature = self._features[index]
        kinds = set(map(type, values))
        if type(None) in kinds:
            values = self._fill_missing(feature, values)
            kinds.discard(type(None))
        codes = self._codes.get(index)
        if codes is not None:
            encoded = [codes.get(v, -1.0) if isinstance(v, str) else -1.0 for v in values]
            column = np.array(encoded, dtype=np.float32)
            if (column < 0).any():
                row = int(np.flatnonzero(column < 0)[0])
                encode_value(feature, values[row])  # raises, naming the value
            return column
        wanted = {bool} if feature.type == "boolean" else {int, float}
        if not kinds <= wanted:
            row = next(n for n, v in enumerate(values) if type(v) not in wanted)
            encode_value(feature, values[row])  # raises, naming the value
        column = np.array(values, dtype=np.float64)
        finite = np.isfinite(column)
        if not finite.all():
            raise _refuse(feature.name, "must be a finite number", "NaN or inf")
        if feature.type == "int" and not (column == np.round(column)).all():
            row = int(np.flatnonzero(column != np.round(column))[0])
            raise _refuse(feature.name, "must be a whole number (int)", values[row])
        return column.astype(np.float32)

    def _fill_missing(self, feature: Feature, values: list[Any]) -> list[Any]:
        if feature.required:
            raise self._missing(feature.name, values.index(None))
        return [feature.default if v is None else v for v in values]

    def _unknown(self, name: str) -> ContractError:
        close = difflib.get_close_matches(name, self.schema.names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return ContractError(
            ErrorCode.bad_feature,
            f"features.{name}"[:160],
            f"unknown feature{hint} The model's features: {_list(self.schema.names)}",
        )

    def _missing(self, name: str, row: int | None) -> ContractError:
        where = "" if row is None else f" (null in row {row})"
        return ContractError(
            ErrorCode.bad_feature,
            f"features.{name}",
            f"required feature missing{where}: send a value (it has no default)",
        )


def _refuse(name: str, message: str, seen: object) -> ContractError:
    return ContractError(ErrorCode.bad_feature, f"features.{name}"[:160], message, seen=seen)


def _list(names: Sequence[str]) -> str:
    shown = ", ".join(names[:20])
    return shown if len(names) <= 20 else f"{shown}, … ({len(names)} in all)"

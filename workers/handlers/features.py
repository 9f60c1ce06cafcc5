"""The worker's check of feature records against a model's ``schemas.features.FeatureSchema``:
records to float32 rows in the schema's order, without pydantic: one record
(``{"features": {...}}``) in a loop over its keys, many (``{"columns": {...}}``) a column
at a time with NumPy, ``.npy`` rows checked for their width and codes.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.errors import ContractError, ErrorCode
from schemas.features import MAX_ROWS, Feature, FeatureSchema, encode_value, listed, refuse


def load_schema(path: Path) -> FeatureSchema:
    """Read a ``.toml`` or ``.json`` schema file (``ValueError`` saying what is wrong)."""
    return FeatureSchema.parse(path.read_text(encoding="utf-8"), json_text=path.suffix == ".json")


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
                f"feature, in order: {listed(self.schema.names)}",
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
            raise refuse(self.schema.names[column], "must be a finite number", "NaN or inf")
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
                    f"a code 0..{top} of {listed(feature.values or ())}"
                    if top is not None
                    else ("0 or 1" if feature.type == "boolean" else "a whole number")
                )
                raise refuse(feature.name, f"must be {kind}", float(values[bad][0]))

    def _length(self, columns: Mapping[str, object]) -> int:
        lengths = {len(v) if isinstance(v, list) else -1 for v in columns.values()}
        if -1 in lengths:
            name = next(n for n, v in columns.items() if not isinstance(v, list))
            raise refuse(name, "a column must be a list of values", columns[name])
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
            raise refuse(feature.name, "must be a finite number", "NaN or inf")
        if feature.type == "int" and not (column == np.round(column)).all():
            row = int(np.flatnonzero(column != np.round(column))[0])
            raise refuse(feature.name, "must be a whole number (int)", values[row])
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
            f"unknown feature{hint} The model's features: {listed(self.schema.names)}",
        )

    def _missing(self, name: str, row: int | None) -> ContractError:
        where = "" if row is None else f" (null in row {row})"
        return ContractError(
            ErrorCode.bad_feature,
            f"features.{name}",
            f"required feature missing{where}: send a value (it has no default)",
        )

"""The feature schema and its check: every violation refused with the feature's name.

Pure: ``workers.handlers.features`` turns records, columns and ``.npy`` rows into float32 rows in
the schema's order; a misspelt, missing-and-required or ill-typed feature is a
``ContractError(bad_feature)`` whose field is ``features.<name>``, never a zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from schemas import ContractError, ErrorCode
from schemas.features import FeatureSchema
from workers.handlers.features import FeatureCheck, load_schema

SCHEMA = FeatureSchema.model_validate(
    {
        "name": "fraud",
        "classes": ["legit", "fraud"],
        "features": [
            {"name": "amount", "type": "float"},
            {
                "name": "merchant",
                "type": "category",
                "values": ["grocery", "travel", "online"],
                "default": "grocery",
            },
            {"name": "hour", "type": "int", "default": 12},
            {"name": "mismatch", "type": "boolean", "default": False},
        ],
    }
)
CHECK = FeatureCheck(SCHEMA)


def refused(call: Any, *args: object) -> ContractError:
    with pytest.raises(ContractError) as caught:
        call(*args)
    assert caught.value.code is ErrorCode.bad_feature
    return caught.value


def test_a_record_becomes_a_row_in_schema_order_with_defaults_filled() -> None:
    row = CHECK.record({"hour": 3, "amount": 12.5, "merchant": "online"})
    assert row.dtype == np.float32
    assert row.tolist() == [12.5, 2.0, 3.0, 0.0]
    assert CHECK.record({"amount": 1, "mismatch": True, "hour": None}).tolist() == [1, 0, 12, 1]


def test_columns_become_rows_checked_a_column_at_a_time() -> None:
    rows = CHECK.columns(
        {
            "amount": [1.0, 2, 3.5],
            "merchant": ["travel", None, "online"],
            "mismatch": [True, False, True],
        }
    )
    assert rows.tolist() == [[1, 1, 12, 1], [2, 0, 12, 0], [3.5, 2, 12, 1]]


@pytest.mark.parametrize(
    ("record", "field", "words"),
    [
        ({"amout": 1.0}, "features.amout", "did you mean 'amount'"),
        ({"merchant": "online"}, "features.amount", "required feature missing"),
        ({"amount": None}, "features.amount", "required feature missing"),
        ({"amount": "12"}, "features.amount", "must be a number"),
        ({"amount": True}, "features.amount", "must be a number"),
        ({"amount": 1, "hour": 3.5}, "features.hour", "whole number"),
        ({"amount": 1, "mismatch": 1}, "features.mismatch", "true or false"),
        (
            {"amount": 1, "merchant": "casino"},
            "features.merchant",
            "one of grocery, travel, online",
        ),
        ({"amount": 1, "merchant": 2}, "features.merchant", "one of"),
    ],
)
def test_every_violation_in_a_record_is_refused_naming_its_feature(
    record: dict[str, object], field: str, words: str
) -> None:
    error = refused(CHECK.record, record)
    assert error.field == field
    assert words in str(error)


@pytest.mark.parametrize(
    ("columns", "field", "words"),
    [
        ({"amount": [1.0], "amout": [2.0]}, "features.amout", "unknown feature"),
        ({"merchant": ["online"]}, "features.amount", "required feature missing"),
        ({"amount": [1.0, None]}, "features.amount", "null in row 1"),
        ({"amount": [1.0, "x"]}, "features.amount", "must be a number"),
        ({"amount": [1.0, False]}, "features.amount", "must be a number"),
        ({"amount": [1.0, 2.0], "hour": [1, 2.5]}, "features.hour", "whole number"),
        ({"amount": [1.0], "mismatch": [0]}, "features.mismatch", "true or false"),
        ({"amount": [1.0, 2.0], "merchant": ["travel", "casino"]}, "features.merchant", "one of"),
        ({"amount": 1.0}, "features.amount", "list of values"),
        ({"amount": [1.0], "hour": [1, 2]}, "columns", "same number of rows"),
        ({"amount": []}, "columns", "1 to 4096 rows"),
    ],
)
def test_every_violation_in_columns_is_refused_naming_its_feature(
    columns: dict[str, object], field: str, words: str
) -> None:
    error = refused(CHECK.columns, columns)
    assert error.field == field
    assert words in str(error)


def test_npy_rows_are_checked_for_shape_finiteness_and_codes() -> None:
    rows = np.array([[1.0, 2, 3, 1], [4.0, 0, 5, 0]])
    assert CHECK.rows(rows).tolist() == rows.tolist()
    assert CHECK.rows(rows[0]).shape == (4,)
    assert "shape (4,)" in str(refused(CHECK.rows, np.zeros((2, 3))))
    assert "float rows" in str(refused(CHECK.rows, np.zeros((2, 4), dtype=np.int64)))
    assert refused(CHECK.rows, np.array([[np.nan, 0, 0, 0]])).field == "features.amount"
    assert refused(CHECK.rows, np.array([[1.0, 3, 0, 0]])).field == "features.merchant"
    assert refused(CHECK.rows, np.array([[1.0, 0, 0.5, 0]])).field == "features.hour"
    assert refused(CHECK.rows, np.array([[1.0, 0, 0, 2]])).field == "features.mismatch"


@pytest.mark.parametrize(
    "features",
    [
        [{"name": "a", "type": "float"}, {"name": "a", "type": "int"}],
        [{"name": "a", "type": "category"}],
        [{"name": "a", "type": "float", "values": ["x"]}],
        [{"name": "a", "type": "category", "values": ["x"], "default": "y"}],
        [{"name": "a", "type": "int", "default": "3"}],
        [{"name": "a", "type": "text"}],
        [],
    ],
)
def test_a_schema_that_contradicts_itself_is_refused_when_read(features: list[object]) -> None:
    with pytest.raises(ValidationError):
        FeatureSchema.model_validate({"features": features})


def test_a_toml_file_reads_as_the_same_schema(tmp_path: Path) -> None:
    path = tmp_path / "model.pt.features.toml"
    path.write_text(
        'name = "fraud"\nclasses = ["legit", "fraud"]\n'
        '[[features]]\nname = "amount"\ntype = "float"\n'
        '[[features]]\nname = "merchant"\ntype = "category"\n'
        'values = ["grocery", "travel", "online"]\ndefault = "grocery"\n'
        '[[features]]\nname = "hour"\ntype = "int"\ndefault = 12\n'
        '[[features]]\nname = "mismatch"\ntype = "boolean"\ndefault = false\n'
    )
    assert load_schema(path) == SCHEMA

"""Feature contributions of gradient-boosted trees: they add up to the raw score, credit
only the features the trees split on, and reach a result through ``tabular:``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import orjson
import pytest
import torch
from sklearn.ensemble import (
    GradientBoostingClassifier,
    GradientBoostingRegressor,
    RandomForestClassifier,
)

from demo.models.fraud import FEATURES, build, record, transactions
from schemas import ContentType, ContractError, ErrorCode
from workers.handlers.contributions import tree_contributions
from workers.handlers.tabular import TabularModel, load_tabular

ROWS = np.random.default_rng(0).normal(size=(600, 4)).astype(np.float32)


def test_contributions_add_up_to_a_classifiers_log_odds() -> None:
    labels = (ROWS[:, 0] + 0.5 * ROWS[:, 1] > 0).astype(int)
    model = GradientBoostingClassifier(n_estimators=40, max_depth=3, random_state=0)
    model.fit(ROWS, labels)
    credit = tree_contributions(model)
    assert credit is not None
    found = credit(ROWS)
    assert found.shape == ROWS.shape
    raw = model.decision_function(ROWS)
    assert credit.base_value + found.sum(axis=1) == pytest.approx(raw, abs=1e-9)
    # The label hangs on features 0 and 1: they carry most of the credit.
    mean = np.abs(found).mean(axis=0)
    assert mean[:2].min() > 5 * mean[2:].max()


def test_a_regressors_contributions_credit_only_the_features_it_splits_on() -> None:
    model = GradientBoostingRegressor(n_estimators=20, random_state=0).fit(ROWS, 3 * ROWS[:, 2])
    credit = tree_contributions(model)
    assert credit is not None
    found = credit(ROWS)
    assert credit.base_value + found.sum(axis=1) == pytest.approx(model.predict(ROWS), abs=1e-9)
    used = {int(f) for stage in model.estimators_ for f in stage[0].tree_.feature if f >= 0}
    assert used == {2}
    assert np.all(found[:, [0, 1, 3]] == 0)


def test_other_models_have_none() -> None:
    labels = (ROWS[:, 0] > 0).astype(int)
    forest = RandomForestClassifier(n_estimators=3, random_state=0).fit(ROWS, labels)
    assert tree_contributions(forest) is None
    three = GradientBoostingClassifier(n_estimators=3).fit(ROWS, np.arange(len(ROWS)) % 3)
    assert tree_contributions(three) is None  # one tree per class: not built


@pytest.fixture(scope="module")
def fraud(tmp_path_factory: pytest.TempPathFactory) -> tuple[TabularModel, TabularModel, Any]:
    gbdt, mlp = build(tmp_path_factory.mktemp("fraud"), train_rows=2000)

    def load(path: Path) -> TabularModel:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation notice
            return load_tabular(
                f"tabular:{path}",
                path,
                weights=None,
                device=torch.device("cpu"),
                allow_pickle=True,
                options={"backend": "native"} if path.suffix == ".joblib" else {},
            )

    return load(gbdt), load(mlp), joblib.load(gbdt)


def _serve(model: TabularModel, payloads: list[bytes], params: list[dict[str, Any]]) -> list[Any]:
    items = [
        model.preprocess(p, ContentType.JSON, q) for p, q in zip(payloads, params, strict=True)
    ]
    with torch.inference_mode():
        return model.postprocess(model.forward(model.collate(items, torch.device("cpu"))), params)


def test_a_result_names_its_top_features_largest_first(fraud: Any) -> None:
    gbdt, _, estimator = fraud
    data = transactions(8, seed=3)
    one = orjson.dumps({"features": record(data, 0)})
    many = orjson.dumps({"columns": data.columns})
    plain, top2, every = _serve(
        gbdt, [one, many, many], [{}, {"contributions": 2}, {"contributions": 5}]
    )
    assert "contributions" not in plain
    raw = estimator.decision_function(data.rows)
    for n, (two, five) in enumerate(zip(top2, every, strict=True)):
        credited = five["contributions"]
        assert sorted(c["feature"] for c in credited["top"]) == sorted(FEATURES)
        values = [abs(c["value"]) for c in credited["top"]]
        assert values == sorted(values, reverse=True)
        total = credited["base_value"] + sum(c["value"] for c in credited["top"])
        assert total == pytest.approx(raw[n], abs=1e-6)
        assert two["contributions"]["top"] == credited["top"][:2]
        assert two["score"] == five["score"]


@pytest.mark.parametrize("asked", [0, 6, "2", True, 1.5])
def test_a_bad_count_is_refused(fraud: Any, asked: object) -> None:
    gbdt = fraud[0]
    payload = orjson.dumps({"features": record(transactions(1, seed=3), 0)})
    with pytest.raises(ContractError) as caught:
        gbdt.preprocess(payload, ContentType.JSON, {"contributions": asked})
    assert caught.value.code == ErrorCode.bad_request
    assert caught.value.field == "params.contributions"


def test_a_model_without_contributions_refuses_the_parameter(fraud: Any) -> None:
    mlp = fraud[1]
    payload = orjson.dumps({"features": record(transactions(1, seed=3), 0)})
    with pytest.raises(ContractError, match="no feature contributions") as caught:
        mlp.preprocess(payload, ContentType.JSON, {"contributions": 2})
    assert caught.value.code == ErrorCode.bad_request

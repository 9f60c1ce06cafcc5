"""Tabular models served by a real worker, against the real broker and Redis.

The fraud demo's GBDT (scikit-learn, converted by Hummingbird) and its MLP (TorchScript)
are trained here in seconds (``demo.models.fraud``) and served as ``tabular:PATH``. One
worker per model answers single records, a columnar request and ``.npy`` rows; every
score equals the model run directly on the same rows. Records that break the schema
(a misspelt, a missing required, an ill-typed feature) are answered ``bad_feature``
naming the feature, and the good records beside them still score. A record that asks
for its top feature contributions gets them from the GBDT; the MLP refuses the ask.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import orjson
import pytest
import torch

from demo.models.fraud import build, record, transactions
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, produce, wait_for_results
from schemas import ContentType, ErrorCode, Status, topics_for
from schemas.request import encode_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECORDS = 40
TOLERANCE = 1e-5
BAD = {
    "bad-misspelt": ({"amout": 10.0, "hour": 3}, "features.amout"),
    "bad-missing": ({"merchant": "online", "hour": 3}, "features.amount"),
    "bad-typed": ({"amount": "ten", "hour": 3}, "features.amount"),
    "bad-category": ({"amount": 1.0, "hour": 3, "merchant": "casino"}, "features.merchant"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("fraud"), train_rows=3000)


def _direct(path: Path, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if path.suffix == ".joblib":
        return np.asarray(joblib.load(path).predict_proba(rows))[:, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation notice
        module = torch.jit.load(str(path))  # type: ignore[no-untyped-call]  # torch: unannotated
    with torch.inference_mode():
        scores: np.ndarray[Any, Any] = module(torch.from_numpy(rows)).numpy()[:, 1]
    return scores


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("which", "backend"), [(0, "hummingbird"), (1, "auto")])
async def test_served_scores_equal_the_model_run_directly_and_bad_features_are_named(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    models: tuple[Path, Path],
    which: int,
    backend: str,
) -> None:
    path = models[which]
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=2)
    options = orjson.dumps({"backend": backend}).decode()
    worker = workers.start(
        *("--allow-pickle-models", "--model-options", options, "--profile", "latency"),
        model=f"tabular:{path}",
    )
    await worker.until_ready(180)

    data = transactions(RECORDS, seed=9)
    records, ids = [], []
    for row in range(RECORDS):
        payload = orjson.dumps({"features": record(data, row)})
        ids.append(f"{model_name}-r{row}")
        records.append(
            encode_request(
                payload, request_id=ids[-1], content_type=ContentType.JSON, source="tests"
            )
        )
    ids.append(f"{model_name}-columns")
    records.append(
        encode_request(
            orjson.dumps({"columns": data.columns}),
            request_id=ids[-1],
            content_type=ContentType.JSON,
            source="tests",
        )
    )
    npy = io.BytesIO()
    np.save(npy, data.rows[:5])
    ids.append(f"{model_name}-npy")
    records.append(
        encode_request(
            npy.getvalue(), request_id=ids[-1], content_type=ContentType.NPY, source="tests"
        )
    )
    # Its top three feature contributions (the GBDT has them; the MLP refuses the ask).
    ids.append(f"{model_name}-credit")
    records.append(
        encode_request(
            orjson.dumps({"features": record(data, 0)}),
            request_id=ids[-1],
            content_type=ContentType.JSON,
            params={"contributions": 3},
            source="tests",
        )
    )
    for name, (features, _) in BAD.items():
        ids.append(f"{model_name}-{name}")
        payload = orjson.dumps({"features": features})
        records.append(
            encode_request(
                payload, request_id=ids[-1], content_type=ContentType.JSON, source="tests"
            )
        )
    await produce(kafka_bootstrap, topics.requests, records)
    results = await wait_for_results(redis_url, ids, timeout_s=120)
    assert set(results) == set(ids), workers.logs()[-3000:]

    direct = _direct(path, data.rows)
    for row in range(RECORDS):
        result = results[f"{model_name}-r{row}"]
        assert result.status is Status.ok, result
        assert result.model_version.startswith(f"{path.name}:sha256-")
        assert abs(result.outputs["score"] - direct[row]) <= TOLERANCE
        assert set(result.outputs["probabilities"]) == {"legit", "fraud"}
    columns = results[f"{model_name}-columns"].outputs
    assert len(columns) == RECORDS
    assert np.abs(np.array([o["score"] for o in columns]) - direct).max() <= TOLERANCE
    rows = results[f"{model_name}-npy"].outputs
    assert np.abs(np.array([o["score"] for o in rows]) - direct[:5]).max() <= TOLERANCE
    credited = results[f"{model_name}-credit"]
    if path.suffix == ".joblib":
        assert credited.status is Status.ok, credited
        assert abs(credited.outputs["score"] - direct[0]) <= TOLERANCE
        top = credited.outputs["contributions"]["top"]
        assert len(top) == 3
        assert [abs(c["value"]) for c in top] == sorted(
            (abs(c["value"]) for c in top), reverse=True
        )
    else:
        assert credited.error is not None, credited
        assert credited.error.code == ErrorCode.bad_request
    for name, (_, field) in BAD.items():
        result = results[f"{model_name}-{name}"]
        assert result.status is Status.error, result
        assert result.error is not None
        assert result.error.code == ErrorCode.bad_feature
        assert result.error.message.startswith(field), result.error.message

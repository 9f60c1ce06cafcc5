"""Tabular models: feature records in, a score or class probabilities out (``tabular:PATH``).

A request is one record (``{"features": {...}}``), many rows as columns (``{"columns":
{...}}``) or ``application/x-npy`` rows already in feature order; every one is checked
against the model's feature schema (``schemas.features``, by
``workers.handlers.features``) in ``preprocess``, so a bad feature fails only its own
request. An item travels as a float32 (F,) row for one record, or (R, F) rows for many;
``collate`` hands the items to ``forward`` as a list, which runs the model once on all
their rows and splits the outputs back per request. A request of R rows is answered with
R outputs.

A request may ask for its records' top feature contributions (``{"contributions": K}``):
the K features that moved the raw score most, each with its signed share, and the base
value they add to (``workers.handlers.contributions``); for gradient-boosted trees only,
and any other model refuses the parameter ``bad_request``.

The model is any callable from an (N, F) float32 tensor to (N,), (N, 1) or (N, C)
scores: a TorchScript or ``torch.export`` module, or a scikit-learn-style estimator
(gradient-boosted trees and the like) run either by its own ``predict_proba`` /
``predict`` (``native``) or as the tensor program Hummingbird converts it to
(``hummingbird``). ``workers.model.loader`` builds these from a spec; docs/models.md
describes the file layout and the result shape.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import orjson
import torch

from schemas import ContentType, ContractError, ErrorCode
from schemas.features import FeatureSchema
from workers.decode.images import read_npy
from workers.handlers.contributions import TreeContributions, tree_contributions
from workers.handlers.features import FeatureCheck, load_schema
from workers.handlers.weights import ModelLoadError, require_file, sha256

log = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "hummingbird", "native"]
BACKENDS = ("auto", "hummingbird", "native")
DEFAULT_TREE_BACKEND: Literal["hummingbird", "native"] = "hummingbird"
"""What ``auto`` picks for an estimator when Hummingbird is installed (else ``native``):
its tensor program answered one row 2.3x sooner than scikit-learn's own predict_proba
and 64 rows as fast, on the 2-core CPU VM
(docs/bench-log/2026-12-01-hummingbird-against-native-predict.md)."""
_TORCH_SUFFIXES = (".pt", ".ts", ".torchscript", ".jit")
_EXPORT_SUFFIXES = (".pt2",)
_ESTIMATOR_SUFFIXES = (".joblib", ".pkl", ".pickle")
_OPTIONS = ("schema", "backend")

Scorer = Callable[[torch.Tensor], torch.Tensor]
CONTRIBUTIONS = "contributions"
"""The request parameter: how many of a record's top feature contributions to answer."""


class Scored(NamedTuple):
    """One request's output rows of scores and the feature rows they scored."""

    scores: torch.Tensor
    rows: torch.Tensor


class TabularModel:
    """A model over feature rows, served as a handler (see the module doc)."""

    def __init__(
        self,
        scorer: Scorer,
        schema: FeatureSchema,
        *,
        name: str,
        version: str,
        contributions: TreeContributions | None = None,
    ) -> None:
        """``scorer`` maps (N, F) float32 rows to (N,), (N, 1) or (N, C) float scores;
        ``contributions``, where the model has them, the raw score's by feature."""
        self.name = name
        self.version = version
        self.schema = schema
        self.check = FeatureCheck(schema)
        self._scorer = scorer
        self._contributions = contributions
        self._labels: tuple[str, ...] | None = schema.classes
        self._names = [feature.name for feature in schema.features]

    def example_item(self) -> torch.Tensor:
        # The defaults, zero where a feature is required: only ever seen by warm-up.
        return torch.from_numpy(self.check.defaults())

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        self._top(params)
        if content_type == ContentType.JSON:
            return torch.from_numpy(self._json(payload))
        if content_type == ContentType.NPY:
            return torch.from_numpy(self.check.rows(read_npy(payload)))
        raise ContractError(
            ErrorCode.unsupported_media_type,
            "content-type",
            f"a tabular model takes {ContentType.JSON} or {ContentType.NPY}",
            seen=str(content_type),
        )

    def _json(self, payload: bytes) -> np.ndarray[Any, np.dtype[np.float32]]:
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise ContractError(ErrorCode.decode_failed, "value", f"not JSON: {exc}") from exc
        if isinstance(document, dict) and len(document) == 1:
            if "features" in document:
                return self.check.record(document["features"])
            if "columns" in document:
                return self.check.columns(document["columns"])
        raise ContractError(
            ErrorCode.bad_feature,
            "value",
            'expected {"features": {name: value, ...}} for one record or '
            '{"columns": {name: [values], ...}} for many rows',
            seen=str(list(document)[:4]) if isinstance(document, dict) else type(document).__name__,
        )

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        # A list, so that the runner neither stacks nor pads: items have their own row counts.
        return list(items)

    def _top(self, params: Mapping[str, Any]) -> int:
        """The ``contributions`` a request asks for (0: none); ``bad_request`` if it
        cannot have them."""
        top = params.get(CONTRIBUTIONS)
        if top is None:
            return 0
        width = self.check.width
        if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= width:
            raise ContractError(
                ErrorCode.bad_request,
                f"params.{CONTRIBUTIONS}",
                f"how many top feature contributions to answer: an integer from 1 to {width}",
                seen=repr(top)[:40],
            )
        if self._contributions is None:
            raise ContractError(
                ErrorCode.bad_request,
                f"params.{CONTRIBUTIONS}",
                "this model gives no feature contributions: they are built for "
                "scikit-learn's gradient-boosted trees (a classifier of two classes or a "
                "regressor)",
            )
        return top

    def forward(self, batch: list[torch.Tensor]) -> list[Scored]:
        rows = [item.view(-1, self.check.width) for item in batch]
        scores = self._scorer(rows[0] if len(rows) == 1 else torch.cat(rows))
        scores = scores.float().reshape(len(scores), -1)
        parts = torch.split(scores, [len(r) for r in rows]) if len(rows) > 1 else (scores,)
        # A (F,) item, one record, is answered with one output (a row of scores).
        return [
            Scored(p[0], item) if item.ndim == 1 else Scored(p, item)
            for p, item in zip(parts, batch, strict=True)
        ]

    def postprocess(self, outputs: list[Scored], params: Sequence[Mapping[str, Any]]) -> list[Any]:
        results: list[Any] = []
        for (scores, rows), p in zip(outputs, params, strict=True):
            values = scores.tolist()
            one = scores.ndim == 1
            answers = [self._output(values)] if one else [self._output(row) for row in values]
            top = self._top(p)
            if top:
                assert self._contributions is not None  # _top refuses it otherwise
                table = rows.reshape(-1, self.check.width).numpy()
                for answer, credit in zip(answers, self._contributions(table), strict=True):
                    answer["contributions"] = self._credited(credit, top)
            results.append(answers[0] if one else answers)
        return results

    def _credited(self, credit: np.ndarray[Any, Any], top: int) -> dict[str, Any]:
        """A record's ``top`` features by the size of their contribution, signed."""
        assert self._contributions is not None
        order = np.argsort(-np.abs(credit), kind="stable")[:top]
        return {
            "base_value": self._contributions.base_value,
            "top": [{"feature": self._names[i], "value": float(credit[i])} for i in order],
        }

    def _output(self, row: list[float]) -> dict[str, Any]:
        """One row's scores: a score alone; with two or more classes, the probabilities
        by label, the best label, and for two classes the second's as the score."""
        if len(row) == 1:
            return {"score": row[0]}
        labels = self._labels or tuple(str(i) for i in range(len(row)))
        best = max(range(len(row)), key=row.__getitem__)
        output: dict[str, Any] = {
            "label": labels[best],
            "probabilities": dict(zip(labels, row, strict=True)),
        }
        if len(row) == 2:
            output["score"] = row[1]
        return output


def load_tabular(
    spec: str,
    path: Path,
    *,
    weights: str | None,
    device: torch.device,
    allow_pickle: bool,
    options: Mapping[str, Any],
) -> TabularModel:
    """The handler for ``tabular:PATH`` (see docs/models.md), its schema checked at load."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ModelLoadError(
            f"{spec}: model options {unknown} do not apply; tabular: takes {', '.join(_OPTIONS)}"
        )
    if weights is not None:
        raise ModelLoadError(f"{spec}: the file holds its weights; leave weights unset")
    require_file(spec, path)
    schema_path = _schema_path(spec, path, options.get("schema"))
    try:
        schema = load_schema(schema_path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(
            f"{spec}: the feature schema {schema_path} is not valid: {exc}"
        ) from exc
    backend = str(options.get("backend", "auto"))
    scorer, estimator = _scorer(spec, path, device, allow_pickle, backend)
    model = TabularModel(
        scorer,
        schema,
        name=path.stem,
        version=f"{path.name}:sha256-{sha256(path)[:12]}+{schema.name}:sha256-"
        f"{sha256(schema_path)[:8]}",
        contributions=tree_contributions(estimator) if estimator is not None else None,
    )
    _probe(spec, model)
    return model


def _schema_path(spec: str, path: Path, named: object) -> Path:
    if named is not None:
        return Path(str(named))
    for suffix in (".features.toml", ".features.json"):
        candidate = path.with_name(path.name + suffix)
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{spec}: no feature schema: put it beside the model as {path.name}.features.toml "
        '(or .json), or name it with --model-options \'{"schema": "PATH"}\''
    )


def _scorer(
    spec: str, path: Path, device: torch.device, allow_pickle: bool, backend: str
) -> tuple[Scorer, object | None]:
    """The scorer, and the estimator behind it (None for a torch model)."""
    suffix = path.suffix.lower()
    if suffix in _TORCH_SUFFIXES + _EXPORT_SUFFIXES:
        if backend not in ("auto", "torch"):
            raise ModelLoadError(f"{spec}: backend {backend!r} is for estimators; leave it unset")
        return _torch_scorer(spec, path, device, allow_pickle), None
    if suffix in _ESTIMATOR_SUFFIXES:
        if backend not in BACKENDS:
            raise ModelLoadError(f"{spec}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
        _pickle_allowed(spec, allow_pickle)
        return _estimator_scorer(spec, path, device, _chosen(backend))
    raise ModelLoadError(
        f"{spec}: {path.name}: a tabular model is a TorchScript file "
        f"({', '.join(_TORCH_SUFFIXES)}), "
        f"a torch.export archive (.pt2) or a pickled estimator ({', '.join(_ESTIMATOR_SUFFIXES)})"
    )


def _chosen(backend: str) -> str:
    if backend != "auto":
        return backend
    if importlib.util.find_spec("hummingbird") is None:
        log.info("serving the estimator by its own predict: Hummingbird is not installed")
        return "native"
    return DEFAULT_TREE_BACKEND


def _pickle_allowed(spec: str, allow_pickle: bool) -> None:
    if not allow_pickle:
        raise ModelLoadError(
            f"{spec}: this file is unpickled when loaded, which can run code stored in it; "
            "serve only files you trust, and say so with --allow-pickle-models"
        )


def _torch_scorer(spec: str, path: Path, device: torch.device, allow_pickle: bool) -> Scorer:
    if path.suffix.lower() in _EXPORT_SUFFIXES:
        _pickle_allowed(spec, allow_pickle)
        try:
            module: torch.nn.Module = torch.export.load(path).module()
        except Exception as exc:
            raise ModelLoadError(f"{spec}: not a torch.export archive: {exc}") from exc
        module = module.to(device)
    else:
        try:
            # torch.jit.load has no annotations in torch's sources.
            module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise ModelLoadError(f"{spec}: not a TorchScript file (torch.jit.save): {exc}") from exc
        module.eval()

    def score(rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = module(rows.to(device))
        return out.cpu()

    return score


def _estimator_scorer(
    spec: str, path: Path, device: torch.device, backend: str
) -> tuple[Scorer, object]:
    import joblib

    try:
        estimator = joblib.load(path)
    except Exception as exc:
        raise ModelLoadError(f"{spec}: not a pickled estimator (joblib.dump): {exc}") from exc
    if backend == "hummingbird":
        return _hummingbird(spec, estimator, device), estimator
    predict = getattr(estimator, "predict_proba", None) or getattr(estimator, "predict", None)
    if predict is None:
        raise ModelLoadError(f"{spec}: the estimator has neither predict_proba nor predict")

    def score(rows: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(predict(rows.numpy()), dtype=np.float32))

    return score, estimator


def _hummingbird(spec: str, estimator: object, device: torch.device) -> Scorer:
    try:
        from hummingbird.ml import convert
    except ImportError as exc:
        raise ModelLoadError(
            f"{spec}: backend hummingbird needs the tabular extra (pip install "
            f"'conveyor-serve[tabular]'): {exc}"
        ) from exc
    try:
        container = convert(estimator, "torch", device=str(device))
    except Exception as exc:
        raise ModelLoadError(f"{spec}: Hummingbird cannot convert this estimator: {exc}") from exc
    module = container.model
    classifier = hasattr(estimator, "predict_proba")

    def score(rows: torch.Tensor) -> torch.Tensor:
        out = module(rows.to(device))
        # Classifiers answer (labels, probabilities), regressors their predictions.
        tensor: torch.Tensor = out[1] if classifier and isinstance(out, tuple) else out
        return tensor.cpu()

    return score


def _probe(spec: str, model: TabularModel) -> None:
    """Run blank batches of one and of two rows: a model that cannot take every batch
    size, or whose outputs do not fit the schema's classes, is refused at start-up."""
    item = model.example_item()
    for size in (1, 2):
        try:
            with torch.inference_mode():
                outputs = model.forward([item.expand(size, -1).contiguous()])
        except Exception as exc:
            raise ModelLoadError(
                f"{spec}: the model failed on a ({size}, {model.check.width}) float batch: {exc}"
            ) from exc
        scores = outputs[0].scores
        columns = scores.shape[-1] if scores.ndim == 2 else 1
        if scores.shape[0] != size:
            raise ModelLoadError(f"{spec}: the model must give one output row per input row")
        classes = model.schema.classes
        if classes is not None and columns != len(classes) and columns > 1:
            raise ModelLoadError(
                f"{spec}: the schema names {len(classes)} classes, the model scores {columns}"
            )

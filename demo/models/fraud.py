"""The fraud demo's data and models: synthetic card transactions, a GBDT and a small MLP.

The generator (``transactions``), with a seeded NumPy generator:

- ``amount``: log-normal, median about 40 (``exp(N(3.7, 1.0))``);
- ``merchant``: one of ``MERCHANTS`` with fixed shares (grocery 35 %, fuel 15 %,
  online 25 %, travel 10 %, electronics 10 %, gambling 5 %);
- ``hour``: 0..23, mostly daytime (a mixture peaked at 13:00, plus 15 % uniform);
- ``country_mismatch``: card country differs from the merchant's, 8 % of transactions;
- ``velocity``: transactions on the card in the last hour, Poisson(1.2).

Fraud is a rule plus noise: a risk score
``1.6·[amount > 300] + 1.4·country_mismatch + 0.5·max(velocity − 2, 0) + 1.2·[hour < 6]
+ 1.0·[merchant in (online, electronics, gambling)] + N(0, 0.7)``, fraudulent above 3.0
(about 3 % of transactions), and 1 % of labels flipped at random.

``python -m demo.models.fraud [FOLDER]`` trains both models in seconds and writes them
with their feature schema beside each: ``fraud-gbdt.joblib`` (scikit-learn's
``GradientBoostingClassifier``) and ``fraud-mlp.pt`` (TorchScript: standardization,
one-hot merchant, two hidden layers, softmax), each answering (N, 2) probabilities.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

MERCHANTS = ("grocery", "fuel", "online", "travel", "electronics", "gambling")
_MERCHANT_SHARES = (0.35, 0.15, 0.25, 0.10, 0.10, 0.05)
_RISKY = (2, 4, 5)
FEATURES = ("amount", "merchant", "hour", "country_mismatch", "velocity")
SCHEMA_TOML = f"""# The fraud demo's features, in the models' input order (demo/models/fraud.py).
name = "fraud-v1"
classes = ["legit", "fraud"]

[[features]]
name = "amount"
type = "float"

[[features]]
name = "merchant"
type = "category"
values = [{", ".join(f'"{m}"' for m in MERCHANTS)}]
default = "grocery"

[[features]]
name = "hour"
type = "int"

[[features]]
name = "country_mismatch"
type = "boolean"
default = false

[[features]]
name = "velocity"
type = "int"
default = 0
"""
DEFAULT_FOLDER = Path(__file__).resolve().parents[2] / ".cache" / "fraud"


@dataclass(frozen=True)
class Transactions:
    """Transactions as columns (the JSON a producer sends), rows and labels."""

    columns: dict[str, list[Any]]
    rows: npt.NDArray[np.float32]  # (N, 5) in schema order, merchant as its index
    fraud: npt.NDArray[np.int64]  # 1 for fraud


def transactions(count: int, seed: int) -> Transactions:
    """``count`` transactions from the generator of the module doc."""
    rng = np.random.default_rng(seed)
    amount = np.round(np.exp(rng.normal(3.7, 1.0, count)), 2)
    merchant = rng.choice(len(MERCHANTS), count, p=_MERCHANT_SHARES)
    day = np.clip(np.round(rng.normal(13, 4, count)), 0, 23)
    hour = np.where(rng.random(count) < 0.15, rng.integers(0, 24, count), day).astype(np.int64)
    mismatch = rng.random(count) < 0.08
    velocity = rng.poisson(1.2, count)
    risk = (
        1.6 * (amount > 300)
        + 1.4 * mismatch
        + 0.5 * np.maximum(velocity - 2, 0)
        + 1.2 * (hour < 6)
        + 1.0 * np.isin(merchant, _RISKY)
        + rng.normal(0, 0.7, count)
    )
    fraud = (risk > 3.0) ^ (rng.random(count) < 0.01)
    rows = np.stack([amount, merchant, hour, mismatch, velocity], axis=1).astype(np.float32)
    columns: dict[str, list[Any]] = {
        "amount": amount.tolist(),
        "merchant": [MERCHANTS[m] for m in merchant],
        "hour": hour.tolist(),
        "country_mismatch": mismatch.tolist(),
        "velocity": velocity.tolist(),
    }
    return Transactions(columns, rows, fraud.astype(np.int64))


def record(data: Transactions, row: int) -> dict[str, Any]:
    """One transaction as the ``features`` object of a request."""
    return {name: data.columns[name][row] for name in FEATURES}


class FraudMLP(torch.nn.Module):
    """Rows in schema order to (N, 2) probabilities: standardized numbers, a one-hot
    merchant, two hidden layers of 32."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.mean: torch.Tensor
        self.std: torch.Tensor
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.categories = len(MERCHANTS)
        width = 4 + self.categories
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(width, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 2),
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        numbers = torch.cat([rows[:, :1].log1p(), rows[:, 2:]], dim=1)
        numbers = (numbers - self.mean) / self.std
        merchant = torch.nn.functional.one_hot(rows[:, 1].long(), self.categories).float()
        logits: torch.Tensor = self.layers(torch.cat([numbers, merchant], dim=1))
        return logits.softmax(dim=1)


def train_mlp(data: Transactions, epochs: int = 8, seed: int = 0) -> FraudMLP:
    """A ``FraudMLP`` trained with Adam on ``data`` (a few seconds on a CPU)."""
    torch.manual_seed(seed)
    rows = torch.from_numpy(data.rows)
    numbers = torch.cat([rows[:, :1].log1p(), rows[:, 2:]], dim=1)
    model = FraudMLP(numbers.mean(0), numbers.std(0) + 1e-6)
    labels = torch.from_numpy(data.fraud)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        # Tensor.split and backward have no annotations in torch's sources.
        for batch in torch.randperm(len(rows)).split(512):  # type: ignore[no-untyped-call]
            optimizer.zero_grad()
            loss = torch.nn.functional.nll_loss(
                model(rows[batch]).clamp_min(1e-7).log(), labels[batch]
            )
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    return model.eval()


def train_gbdt(data: Transactions) -> Any:
    """scikit-learn's ``GradientBoostingClassifier`` (60 trees of depth 3) on ``data``."""
    from sklearn.ensemble import GradientBoostingClassifier

    return GradientBoostingClassifier(n_estimators=60, max_depth=3, random_state=0).fit(
        data.rows, data.fraud
    )


def build(folder: Path = DEFAULT_FOLDER, train_rows: int = 10_000) -> tuple[Path, Path]:
    """Train both models and write them with their schemas; returns (gbdt, mlp) paths."""
    import joblib

    folder.mkdir(parents=True, exist_ok=True)
    data = transactions(train_rows, seed=1)
    gbdt, mlp = folder / "fraud-gbdt.joblib", folder / "fraud-mlp.pt"
    joblib.dump(train_gbdt(data), gbdt)
    example = torch.from_numpy(data.rows[:8])
    # torch.jit.trace has no annotations in torch's sources.
    with warnings.catch_warnings():
        # TorchScript is deprecated in favour of torch.export, but still a served form.
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(train_mlp(data), example)  # type: ignore[no-untyped-call]
        torch.jit.save(traced, str(mlp))
    for path in (gbdt, mlp):
        path.with_name(path.name + ".features.toml").write_text(SCHEMA_TOML)
    return gbdt, mlp


if __name__ == "__main__":
    for built in build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER):
        print(built)

"""docs/models.md's handler example, served as written: the page stays true."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from schemas import DEFAULT_LIMITS, ContentType, ContractError, ErrorCode
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


@pytest.fixture
def example_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The page's example saved as the module its first line names."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    (code,) = [block for block in blocks if block.startswith("# my_handlers.py")]
    (tmp_path / "my_handlers.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_handlers"
    sys.modules.pop("my_handlers", None)


def png(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (30, 20), value).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_documented_handler_serves_requests(example_module: str) -> None:
    handler = load_handler(
        f"{example_module}:Brightness", device="cpu", weights=None, dtype="auto",
        channels_last=None, limits=DEFAULT_LIMITS,
    )  # fmt: skip
    runner = ModelRunner(handler, "cpu")
    runner.warm_up([2])
    requests: tuple[tuple[int, dict[str, int]], ...] = ((10, {}), (250, {"bins": 2}))
    items = [handler.preprocess(png(v), ContentType.PNG, p) for v, p in requests]

    dark, bright = runner.run(items, [{}, {"bins": 2}])

    assert dark == {"shares": [1.0, 0.0, 0.0, 0.0]}
    assert bright == {"shares": [0.0, 1.0]}
    with pytest.raises(ContractError) as caught:
        handler.preprocess(png(0), ContentType.PNG, {"bins": 0})
    assert (caught.value.code, caught.value.field) == (ErrorCode.bad_request, "ce_params.bins")

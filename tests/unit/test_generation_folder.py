"""What an hf: folder and the installed transformers say before a generation model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.generation.folder import auto_dtype, causal_lm_architecture, transformers_problem


def _folder(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_causal_lm_is_told_from_another_task(tmp_path: Path) -> None:
    assert causal_lm_architecture(_folder(tmp_path, architectures=["LlamaForCausalLM"])) == (
        "LlamaForCausalLM"
    )
    assert causal_lm_architecture(_folder(tmp_path, architectures=["BertModel"])) is None
    assert causal_lm_architecture(str(tmp_path / "missing")) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert causal_lm_architecture(str(tmp_path)) is None


@pytest.mark.parametrize(
    ("installed", "refused"),
    [
        ("5.17.0", True),
        ("5.0.0", True),
        ("4.57.1", True),
        ("5.18.0", False),
        ("5.24.0.dev0", False),
    ],
)
def test_a_transformers_older_than_the_engine_needs_is_refused_with_the_version(
    installed: str, refused: bool
) -> None:
    problem = transformers_problem(installed)
    assert (problem is not None) == refused
    if problem:
        assert installed in problem
        assert ">= 5.18" in problem


def test_the_installed_transformers_runs_the_engine() -> None:
    assert transformers_problem() is None


@pytest.mark.parametrize(
    ("config", "device", "dtype"),
    [
        ({"dtype": "bfloat16"}, "cuda", torch.bfloat16),
        ({"torch_dtype": "float16"}, "cuda", torch.float16),
        ({"dtype": "float32"}, "cuda", torch.float32),
        ({}, "cuda", torch.float32),
        ({"dtype": "bfloat16"}, "cpu", torch.float32),
    ],
)
def test_auto_runs_a_causal_lm_on_a_gpu_in_the_precision_it_was_saved_in(
    tmp_path: Path, config: dict[str, str], device: str, dtype: torch.dtype
) -> None:
    assert auto_dtype(_folder(tmp_path, **config), torch.device(device)) == dtype

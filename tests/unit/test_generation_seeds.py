"""Per-request seeds (``workers.generation.seeds``): the Gumbel-max draw keeps sampling's
distribution, depends only on a request's seed and the token's place, and a seeded
request through the real engine (the tiny Llama, CPU) gives the same tokens alone and
beside other requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.generation.requests import Prompt, Sampling
from workers.generation.seeds import SeededDraws, draw_key, gumbel


def test_the_noise_of_a_row_depends_on_its_key_alone() -> None:
    keys = torch.tensor([7, 8, 7], dtype=torch.int32)
    noise = gumbel(keys, 50)
    assert noise.shape == (3, 50)
    assert torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(gumbel(keys[1:2], 50)[0], noise[1])  # whatever else is in the batch
    assert draw_key(5, 0) != draw_key(5, 1) != draw_key(6, 1)
    assert 0 <= draw_key(2**62, 10**6) < 2**31


def test_draws_follow_the_softmax_and_keep_one_token() -> None:
    probabilities = torch.tensor([0.6, 0.3, 0.1, 0.0])
    scores = probabilities.log().expand(20_000, 4)
    keys = torch.tensor([draw_key(s, 0) for s in range(20_000)], dtype=torch.int32)
    kept = SeededDraws()(scores.clone(), keys)
    assert torch.equal((kept == 0).sum(dim=1), torch.ones(20_000, dtype=torch.int64))
    shares = (kept == 0).float().mean(dim=0)
    assert torch.allclose(shares, probabilities, atol=0.015)  # 20,000 draws: sd below 0.004


class _State:
    def __init__(self, **kwargs: Any) -> None:
        self.logit_processor_kwargs = kwargs


class _Request:
    def __init__(self, state: _State) -> None:
        self.state = state


def test_each_draw_of_a_request_gets_the_next_key_and_an_unseeded_one_a_seed_of_its_own() -> None:
    draws = SeededDraws()
    seeded, other = _State(seed=42), _State()
    first = draws.prepare_tensor_args([_Request(seeded), _Request(other)])
    second = draws.prepare_tensor_args([_Request(seeded)])
    assert first[0] == draw_key(42, 0)
    assert second[0] == draw_key(42, 1)
    assert isinstance(other.logit_processor_kwargs["seed"], int)


async def _generate(engine: Any, prompts: list[tuple[str, Prompt]]) -> dict[str, list[int]]:
    done: dict[str, asyncio.Future[list[int]]] = {}
    loop = asyncio.get_running_loop()
    for name, prompt in prompts:
        future: asyncio.Future[list[int]] = loop.create_future()
        done[name] = future

        def on_output(output: Any, future: asyncio.Future[list[int]] = future) -> None:
            if output.is_finished() and not future.done():
                future.set_result(list(output.generated_tokens))

        engine.add(name, prompt, on_output)
    return {name: await asyncio.wait_for(f, 120) for name, f in done.items()}


@pytest.mark.timeout(300)
async def test_a_seeded_request_draws_the_same_tokens_alone_and_beside_others(
    tiny_llm: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from workers.generation.engine import Engine, EngineOptions

    model = AutoModelForCausalLM.from_pretrained(tiny_llm).eval()
    engine = Engine(model, [], EngineOptions(max_sequences=8))
    engine.start()
    try:
        tokens = [5, 17, 33, 80, 11]

        def prompt(seed: int | None, ids: list[int] = tokens) -> Prompt:
            return Prompt(ids, 24, Sampling(temperature=1.0, seed=seed))

        alone = await _generate(engine, [("a", prompt(7))])
        others = [("b", prompt(None, [9, 9, 4])), ("d", prompt(8)), ("e", prompt(None))]
        crowd = await _generate(engine, [others[0], ("c", prompt(7)), *others[1:]])
    finally:
        engine.stop()
    assert len(alone["a"]) == 24
    assert crowd["c"] == alone["a"]  # the same seed, others in its steps
    assert crowd["d"] != alone["a"]  # another seed draws otherwise

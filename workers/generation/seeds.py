"""Per-request seeds for the engine: each token drawn by the Gumbel-max trick from noise
that depends only on the request's seed and the token's place, so that a seeded
request samples the same tokens whichever requests share its steps.

transformers' continuous batching samples every request of a step with one
``torch.multinomial`` call on one generator, so a request's draws depend on the
batch. ``SeededDraws`` is a per-request logits processor, run after temperature,
top-k and top-p: for each row it adds Gumbel noise ``-log(-log(u))`` to the processed
scores, with ``u`` a hash of (the request's key for this token, the vocabulary index),
keeps the arg-max and sets every other score to minus infinity. The arg-max of the
scores plus Gumbel noise is a draw from their softmax, so sampling keeps its
distribution; the manager's own draw then has one token left to pick.

A request's key for its n-th drawn token is a hash of its seed and n, counted here
(each time the manager prepares a step in which the request draws a token), not read
from its generated tokens, which an asynchronous step has not appended yet. A request
without a seed is given a random one, so that two such requests do not share draws.
The noise is computed on the device from one 32-bit key a row, with integer operations
of fixed shapes: a step captured in a CUDA graph replays it.

What is repeatable: the same prompt, parameters and seed on the same model, device and
dtype give the same tokens; a batch's other requests change the scores only by the
kernels' rounding, which can flip a draw whose two best candidates are that close.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

_STEP = "_conveyor_seed_step"  # the count of a request's draws, kept in its own kwargs
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix(value: int) -> int:
    """splitmix64's finalizer on a Python int (the key of a request's draw)."""
    value &= _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def draw_key(seed: int, step: int) -> int:
    """The 31-bit key of the ``step``-th token a request of ``seed`` draws."""
    return _mix(seed * _GOLDEN + step) & 0x7FFFFFFF


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 patterns (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise of shape ``(len(keys), vocab)``: row ``r`` a function of ``keys[r]``
    alone, float32 on the keys' device."""
    index = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = keys.to(torch.int64).unsqueeze(-1) * _signed(_GOLDEN) + index
    x = x ^ _shift(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shift(x, 27)
    x = x * _signed(_MIX2)
    x = x ^ _shift(x, 31)
    uniform = (_shift(x, 40).to(torch.float32) + 0.5) / float(1 << 24)  # in (0, 1)
    return -torch.log(-torch.log(uniform))


class SeededDraws(ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
    """Keeps, in each row, the one token its Gumbel-max draw picks (module doc)."""

    supported_kwargs: ClassVar[dict[str, type]] = {"seed": int}
    ignored_kwargs: ClassVar[tuple[str, ...]] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        keys = []
        for request in requests_with_new_token:
            kwargs = request.state.logit_processor_kwargs
            seed = kwargs.setdefault("seed", secrets.randbits(63))
            step = kwargs.get(_STEP, 0)
            kwargs[_STEP] = step + 1
            keys.append(draw_key(seed, step))
        return torch.tensor(keys, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)]
        chosen = (scores + gumbel(keys, scores.size(-1))).argmax(dim=-1, keepdim=True)
        kept = torch.full_like(scores, float("-inf"))
        return kept.scatter_(-1, chosen, 0.0)


def add_seeded_draws(processors: Any) -> None:
    """Append ``SeededDraws`` to a manager's ``ContinuousBatchingLogitsProcessorList``,
    before its batch processor sizes the processors' argument rows (``warmup``)."""
    draws = SeededDraws()
    processors.logits_processor.append(draws)
    processors.tensors_required += 1
    processors.supported_keys.update(draws.supported_kwargs)
    processors.do_processing = True

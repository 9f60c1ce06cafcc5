"""A tiny causal LM for the generation tests: a Llama of 2 layers, hidden size 64, random
weights, and a byte-level BPE tokenizer trained here on the repository's LICENSE,
saved with ``save_pretrained`` into a folder that ``hf:FOLDER`` serves."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from schemas import ErrorCode, Result, Status

if TYPE_CHECKING:
    from producers.client import AsyncClient
    from producers.token_stream import StreamEvent

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
EOS = "</s>"
BOS = "<s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_llm(folder: Path, seed: int = 0) -> Path:
    """Save the tiny model and its tokenizer into ``folder``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [(ROOT / "LICENSE").read_text()]  # a text that does not change
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits spread out: a random model's greedy path has no near-ties
        model.lm_head.weight.mul_(8.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy_reference(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate`` run directly, greedy: the new tokens' ids (through the first
    end-of-sequence token, which it stops at)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


async def cancel_mid_stream(
    client: AsyncClient, request_id: str
) -> tuple[list[StreamEvent], Result]:
    """Read ``request_id``'s stream and cancel it at its third event (a chunk): its result
    is ``cancelled`` during generation and its stream ends with that error. Returns the
    events read and the result."""
    seen: list[StreamEvent] = []
    async for event in client.stream(request_id, timeout=120):
        seen.append(event)
        if event.type == "chunk" and len(seen) == 3:
            await client.cancel(request_id)
    cancelled = await client.wait(request_id, timeout=120)
    assert cancelled.status is Status.error, cancelled
    assert cancelled.error is not None
    assert cancelled.error.code is ErrorCode.cancelled
    assert "during generation" in cancelled.error.message
    assert seen[-1].type == "error"
    assert seen[-1].code == "cancelled"
    return seen, cancelled

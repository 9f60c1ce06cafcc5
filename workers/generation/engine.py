"""The engine core: transformers' ``ContinuousBatchingManager``, fed from the event loop.

The manager runs its own thread: at every step it admits waiting requests as the
paged KV cache allows, runs one forward over every running sequence (prefill chunks
and decodes mixed), samples, and retires finished or cancelled sequences, freeing
their cache blocks. ``Engine`` adds a request with a callback that the manager
calls on the event loop (one hop per step for all requests), cancels requests and
says what runs and what the cache holds.

Per-request sampling: the manager is built with per-request temperature, top-k and
top-p processors (so its generation config sets all three to values that create
them), and after them ``workers.generation.seeds``' draw, which picks each row's token
from noise of the request's own seed (the manager's one generator for the whole batch
then has one token left to pick): a seeded request samples the same tokens whichever
requests share its steps. Greedy decoding is temperature 1 with top-k 1, which leaves
the arg-max alone to be drawn.

Memory: on a GPU the cache takes ``kv_memory_fraction`` of what the card has free
once the weights are loaded (the manager sizes it); on the CPU ``kv_cache_mb``
bounds it. ``plan`` says what was chosen, at start.

Speed on CUDA: without flash attention the manager's attention is sdpa with a dense
mask, and its own rule then turns CUDA graphs and async batching off. On one H200 at 64
in flight the step was bound by the host (the card 12-15% busy), and 65% of the engine
thread's samples were inside ``scaled_dot_product_attention`` itself (docs/bench-log,
2026-12-02). ``cuda_graphs`` and ``async_batching`` can ask for both; they stay the
manager's choice until a card measures them (``bench.generate --variants``). Both are
off on the CPU.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from workers.generation.requests import Prompt
from workers.generation.seeds import add_seeded_draws

log = logging.getLogger(__name__)

OnOutput = Callable[[GenerationOutput], None]

# Values that make the manager build its temperature, top-k and top-p processors
# (none is built for a neutral value); every request passes its own.
_BUILD_TEMPERATURE = 0.5
_BUILD_TOP_K = 50
_BUILD_TOP_P = 0.9

FINISHED = RequestStatus.FINISHED
FAILED = RequestStatus.FAILED


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the engine is sized (model options of an ``hf:`` causal LM)."""

    max_sequences: int = 32
    """Sequences in the running batch at most."""
    max_batch_tokens: int | None = None
    """Tokens in one step at most (prefill chunks and decodes); None: the manager's."""
    page_size: int = 64
    """Tokens per KV cache page."""
    kv_memory_fraction: float = 0.8
    """On a GPU: the share of the memory free beside the weights the cache takes."""
    kv_cache_mb: int = 64
    """On the CPU: the KV cache's size."""
    cuda_graphs: bool | None = None
    """On CUDA: capture each step's launches in CUDA graphs; None: the manager decides."""
    async_batching: bool | None = None
    """On CUDA: prepare the next batch while this one runs; None: the manager decides."""
    attention: str | None = None
    """The attention implementation to switch the model to (``sdpa``, ``paged|eager``);
    None: the model's own."""
    cudnn_attention: bool | None = None
    """On CUDA, False: PyTorch's attention never takes cuDNN's kernel in this process (it
    plans each new shape on the host, and a step's shapes change every step: text batches
    of varied shape took 73.6 ms with it against 12.8 without on one H200, docs/bench-log
    2026-12-03); None: PyTorch's choice."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the engine set aside, said at start."""

    device: str
    kv_cache_bytes: int
    kv_blocks: int
    page_size: int
    max_batch_tokens: int
    max_sequences: int
    weights_bytes: int
    free_bytes: int | None  # on a GPU: free beside the weights before the cache
    total_bytes: int | None

    def describe(self) -> str:
        mib = 1024 * 1024
        tokens = self.kv_blocks * self.page_size
        where = (
            f"{self.free_bytes / mib:.0f} MiB free of {self.total_bytes / mib:.0f} MiB beside "
            f"{self.weights_bytes / mib:.0f} MiB of weights"
            if self.free_bytes is not None and self.total_bytes is not None
            else f"host memory, beside {self.weights_bytes / mib:.0f} MiB of weights"
        )
        return (
            f"KV cache on {self.device}: {self.kv_cache_bytes / mib:.1f} MiB ({where}), "
            f"{self.kv_blocks} blocks of {self.page_size} tokens = {tokens} tokens; "
            f"{self.max_sequences} sequences and {self.max_batch_tokens} tokens a step at most"
        )


class Engine:
    """One model's continuous-batching engine; ``start`` before ``add``."""

    def __init__(self, model: PreTrainedModel, eos: list[int], options: EngineOptions) -> None:
        self.options = options
        self._model = model
        self.eos = eos
        """The end-of-sequence token ids."""
        self._vocab = int(model.config.get_text_config().vocab_size)
        device = model.device
        free, total = _card_memory(device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        sizing: dict[str, Any]
        if device.type == "cuda":  # the manager sizes the cache from the card's free memory
            sizing = {
                "max_memory_percent": options.kv_memory_fraction,
                "max_batch_tokens": options.max_batch_tokens,
                "use_cuda_graph": options.cuda_graphs,
                "use_async_batching": options.async_batching,
            }
        else:
            blocks = options.kv_cache_mb * 1024 * 1024 // _bytes_per_block(model, options)
            sizing = {
                "num_blocks": max(2, blocks),
                "max_batch_tokens": options.max_batch_tokens or 256,
                "use_cuda_graph": False,
            }
        if options.attention is not None:
            model.set_attn_implementation(options.attention)
        if options.cudnn_attention is not None and device.type == "cuda":
            # Process-wide: the manager steps in a thread of its own.
            torch.backends.cuda.enable_cudnn_sdp(options.cudnn_attention)
        cb = ContinuousBatchingConfig(
            per_request_processors=True,
            page_size=options.page_size,
            max_requests_per_batch=options.max_sequences,
            allow_block_sharing=False,  # prompts of a queue rarely share prefixes
            **sizing,
        )
        config = GenerationConfig(
            do_sample=True,
            temperature=_BUILD_TEMPERATURE,
            top_k=_BUILD_TOP_K,
            top_p=_BUILD_TOP_P,
            eos_token_id=eos or -1,
            max_new_tokens=1,
        )
        self._manager: ContinuousBatchingManager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=cb
        )
        add_seeded_draws(self._manager.logit_processor)  # before warmup sizes its arguments
        self._manager.warmup()  # builds the cache now: its size is known at start
        processor = self._manager.batch_processor
        assert processor is not None
        cache = processor.cache
        self._cache = cache
        self._scheduler = processor.scheduler
        self.plan = Plan(
            device=str(device),
            kv_cache_bytes=int(cache.cache_tensor.numel()),
            kv_blocks=int(cache.num_blocks),
            page_size=options.page_size,
            max_batch_tokens=int(cache.max_batch_tokens),
            max_sequences=options.max_sequences,
            weights_bytes=weights,
            free_bytes=free,
            total_bytes=total,
        )
        self._count = 0
        self._process = secrets.token_hex(4)  # runs of two processes never share a name

    @property
    def max_tokens(self) -> int:
        """Prompt and new tokens of one sequence at most: what the whole cache holds."""
        return self.plan.kv_blocks * self.plan.page_size

    def start(self) -> None:
        self._manager.start()

    def stop(self) -> None:
        """Stop the engine's thread; what runs is dropped (its records stay uncommitted)."""
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=10.0, hard_stop=True)

    def alive(self) -> bool:
        return bool(self._manager.is_running())

    def add(self, request_id: str, prompt: Prompt, on_output: OnOutput) -> str:
        """Start generating ``prompt``; ``on_output`` gets each step's state on the event
        loop (called from it), the last one finished or failed. Returns the name of
        this run: the request's id, this process's random tag and a counter, so that a
        request generated again, by this worker or another, is another run."""
        self._count += 1
        run = f"{request_id}#{self._process}-{self._count}"
        self._manager.register_result_handler(run, on_output)
        self._manager.add_request(
            prompt.token_ids,
            request_id=run,
            max_new_tokens=prompt.max_new_tokens,
            streaming=True,
            record_timestamps=True,
            eos_token_id=self.eos or -1,
            **self._sampling(prompt),
        )
        return run

    def cancel(self, run: str) -> None:
        """Stop ``run`` at the next step and free its cache blocks; no output follows."""
        with self._manager.output_router._lock:
            self._manager.output_router.result_handlers.pop(run, None)
        self._manager.cancel_request(run)

    def _sampling(self, prompt: Prompt) -> dict[str, Any]:
        s = prompt.sampling
        seed = {} if s.seed is None else {"seed": s.seed}
        if s.greedy:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0} | seed
        top_k = s.top_k if s.top_k > 0 else self._vocab
        return {"temperature": s.temperature, "top_k": top_k, "top_p": s.top_p} | seed

    def sequences(self) -> tuple[int, int]:
        """Running and waiting sequences now (read from the engine's thread's state)."""
        return len(self._scheduler.active_requests), len(self._scheduler.waiting_requests)

    def kv_bytes_in_use(self) -> int:
        free = float(self._cache.compute_free_capacity(relative=True))
        return round((1.0 - free) * self.plan.kv_cache_bytes)


def _bytes_per_block(model: PreTrainedModel, options: EngineOptions) -> int:
    """KV bytes of one block of ``page_size`` tokens over every layer."""
    config = model.config.get_text_config()
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    layers = int(config.num_hidden_layers)
    size = torch.empty((), dtype=model.dtype).element_size()
    return 2 * layers * heads * head_dim * options.page_size * size


def _card_memory(device: torch.device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)

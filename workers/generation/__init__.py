"""Generation: causal language models served by a running continuous-batching engine.

Not a batch in, batch out model: requests join the engine's running batch one by one
and leave it at any step. The room is split as vLLM splits its engine:

- ``loading``: a local ``hf:`` folder whose config names a ``*ForCausalLM`` becomes a
  ``Generator`` (model, tokenizer, limits);
- ``requests``: a payload and its ``ce_params`` become a ``Prompt`` (pure; every bad
  input a ``ContractError`` with its code);
- ``engine``: the engine core, transformers' ``ContinuousBatchingManager`` (scheduling
  steps, paged KV cache), fed and cancelled from the event loop;
- ``outputs``: the output processor, each step's tokens into per-request text deltas
  (stop strings held back until they cannot start a stop) and one final answer;
- ``stage``: the pipeline's model stage for an engine (``workers.types.ModelStage``):
  admission by lane, deadlines and cancellations while running, chunks to
  ``workers.publish.streams`` and finals to the publish stage, as every model's.
"""

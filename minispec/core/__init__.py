"""The core: a complete small speculative-decoding engine, read top to bottom in this order.

    config.py       ModelConfig: a Llama-family decoder's hyper-parameters, validated; RoPE frequencies
    model.py        BatchMetadata, AttentionBackend (Triton kernels or their torch twins), the decoder
    kv_cache.py     the paged KV cache: page allocator, block tables, the pools
    sequence.py     a request's tokens, pages and status
    scheduler.py    continuous batching with preemption
    randomness.py   keyed uniforms: each request's draws independent of the batch
    sampling.py     SamplingParams, temperature / top-k / top-p, sampling
    runner.py       ModelRunner: packs a step's sequences into one forward
    speculative.py  the speculative step and its rejection rule
    drafters.py     the drafter interface, a draft model and n-gram drafting
    engine.py       Engine: the loop

The core imports only torch, numpy, the standard library, minispec.kernels and itself. The
production engine around it (the rest of minispec) plugs in at four objects, each with a plain
default here: the scheduler's `Admission` and `StepBudget`, the engine's `StepHook`s, and the
`Drafter`. Where a production class replaces a piece of the core rather than adding around it,
it subclasses and overrides one named method: `Engine.make_sequence`, `make_record`, `run_step`;
`Sequence.append`, `preempted`; `DraftLoop.next_logits`, `adjust`, `draw`; `Transformer.run_layers`
(its `visit`); `AttentionBackend.paged`; `KVCache.new_pool`. Objects where an extension is optional
and composes with others, a method where there is one production version of a piece.
"""

"""How an `LLM`'s engine is built from its options: load the target and the drafter's model, split
the KV budget into one paged pool per model, choose the drafter, and lay out static shapes (CUDA
graphs) where they apply.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from .drafters.base import Drafter
from .drafters.draft_model import ModelDrafter
from .drafters.eagle import EagleDrafter
from .drafters.lookup import LookupFirstDrafter
from .drafters.ngram import NgramDrafter
from .drafters.reduced_vocab import reduce_to_frequent
from .drafters.tree import TreeDrafter, tree_slots
from .engine import LLMEngine
from .fast.int4 import quantize_int4_model
from .fast.int8 import quantize_model
from .fast.row_invariant import make_row_invariant
from .io.checkpoint import load_checkpoint, peek_checkpoint
from .io.eagle_checkpoint import check_head_fits, is_eagle_checkpoint, load_eagle
from .io.tokenizer import Tokenizer
from .model.attention import AttentionBackend
from .model.eagle import EagleModel
from .model.config import ModelConfig
from .model.llama import Transformer
from .options import EngineOptions
from .runtime.kv_cache import KVCache, PageAllocator
from .runtime.prefix_cache import CachingAllocator
from .runtime.runner import ModelRunner
from .runtime.static_shapes import RowInput, StaticShapes


def build_engine(o: EngineOptions) -> tuple[LLMEngine, Tokenizer]:
    """The engine and the target's tokenizer, as the options say."""
    backend = AttentionBackend(o.backend)
    check_pair(o)  # before either model's weights are read
    early = None  # a draft model from a path loads first: its load peaks (int4: while quantizing) before the target is held
    if o.uses_model_drafter and isinstance(o.draft_model, (str, Path)) and not is_eagle_checkpoint(o.draft_model):
        early = load_draft_model(o, o.device, backend)
    target, tokenizer = load_model(o.model, o.quantization, o, o.device, backend)
    if o.row_invariant:
        make_row_invariant(target)  # the target only: any draft is exact
    if o.tokenizer is not None:
        tokenizer = Tokenizer.from_dir(Path(o.tokenizer))
        needed = max(tokenizer.get_vocab().values(), default=-1) + 1
        if needed > target.cfg.vocab_size:
            raise ValueError(f"tokenizer {o.tokenizer} has ids up to {needed - 1}; the target's vocab_size is "
                             f"{target.cfg.vocab_size}")
    draft = load_draft(o, target, tokenizer, backend, early)
    models = [target] + ([draft] if draft is not None else [])
    caches = kv_caches(o, models)
    runners = [ModelRunner(m, c) for m, c in zip(models, caches)]
    max_len = context_length(o, target)
    for r in runners:
        r.max_positions = min(r.max_positions, max_len)
    drafter = make_drafter(o, target, runners[1] if draft is not None else None)
    graphs = use_cuda_graphs(o, models)
    engine = LLMEngine(runners[0], tokenizer, drafter, runners[1] if draft is not None else None,
                       o.num_speculative_tokens, o.max_num_seqs, o.max_num_batched_tokens, o.seed, o.enable_prefix_caching,
                       o.speculation_by_load, o.enable_chunked_prefill, o.pathwise_sampling)
    if o.static_shapes if o.static_shapes is not None else graphs:
        layers = engine.drafter.target_layers
        trees = engine.drafter.drafts_trees  # then a verification feeds the root and the tree's nodes
        query_len = 1 + (max(o.draft_tree_budget, engine.k) if trees else engine.k)
        runners[0].use_static_shapes(query_len, o.max_num_seqs, graphs, trees, **({"hidden_layers": layers} if layers else {}))
        if draft is not None:
            use_draft_static_shapes(o, runners[1], target, engine.k, trees, graphs)
    if o.verbose:
        for name, c in zip(("target", "draft"), caches):
            print(f"[minispec] {name} KV cache: {c.num_pages} pages x {o.page_size} tokens ({c.nbytes / 2**30:.3f} GiB, "
                  f"{c.num_pages * o.page_size} tokens), backend={target.backend.name}", file=sys.stderr)
    return engine, tokenizer


def use_draft_static_shapes(o: EngineOptions, runner: ModelRunner, target: Transformer, k: int, trees: bool,
                            graphs: bool) -> None:
    """Static shapes for the drafter's runner, its buckets' query lengths the feeds it makes:
    1 (a chained step), k + 1 (a catch-up on a step's accepted tokens: an EAGLE head's always,
    a draft model's after a tree or looked-up step), 2 (a draft model's chain catches up on 1 or
    2 tokens) and top_k (a tree level's frontier). A longer catch-up (after several looked-up
    steps) is fed in pieces of the largest (drafters/draft_model.py, drafters/eagle.py); a prompt
    runs dynamically. An EAGLE head's forward has two variants: the catch-up projects the target's
    features [n, len(aux_layers) * H], a chained step or tree level reads the head's own g [n, H]."""
    eagle = isinstance(runner.model, EagleModel)
    query_lens = {1, k + 1} | ({o.draft_tree_top_k} if trees else set()) | (set() if eagle else {2})
    variants = [{}]
    if eagle:
        cfg = runner.model.config
        features = RowInput(len(cfg.aux_layers) * cfg.target_hidden_size, target.dtype)  # the target's, [n, 3H]
        variants = [dict(hidden=features, project=True),
                    dict(hidden=RowInput(cfg.layer.hidden_size, runner.model.dtype), project=False)]  # g [n, H]
    runner.static = StaticShapes(runner, tuple(query_lens), o.max_num_seqs, trees, role="draft",
                                 carry_at_logit_rows=eagle)
    if graphs:
        runner.static.capture(variants)


def load_model(model, quantization: str | None, o: EngineOptions, device, backend: AttentionBackend,
               dtype=None) -> tuple[Transformer, Tokenizer]:
    """A checkpoint path loaded with `quantization` (in `dtype`, else o.dtype), or a built
    (model, tokenizer) pair checked."""
    if isinstance(model, tuple):
        return check_built(model[0], quantization, "a model"), model[1]
    return load_checkpoint(model, dtype=dtype or o.dtype, device=device, backend=backend, quantization=quantization)


def draft_dtype(o: EngineOptions):
    """The dtype a draft from a path loads in: o.dtype, except that "auto" beside a built target
    means the target's dtype (as an EAGLE head's does), not the CPU's fp32 default."""
    if o.dtype in (None, "auto") and isinstance(o.model, tuple):
        return o.model[0].dtype
    return o.dtype


def load_draft(o: EngineOptions, target: Transformer, tokenizer: Tokenizer, backend: AttentionBackend,
               loaded: tuple[Transformer, Tokenizer] | None = None) -> Transformer | EagleModel | None:
    """The drafter's model: an EAGLE head for this target, a draft model sharing its tokenizer
    (`loaded` if it was loaded already), or None (plain decoding, the n-gram drafter)."""
    draft_model = o.draft_model
    if not o.uses_model_drafter:
        return None
    if isinstance(draft_model, EagleModel):  # built for this target? (see io/eagle_checkpoint.build_eagle)
        check_head_fits(draft_model, target)
        return check_built(draft_model, o.quantization, "draft_model")
    if isinstance(draft_model, (str, Path)) and is_eagle_checkpoint(draft_model):
        return quantize_model(load_eagle(draft_model, target), o.quantization)
    # A draft model may be quantized on its own (fast/int4.py): exact for any draft.
    draft, draft_tokenizer = loaded or load_draft_model(o, target.device, backend)
    check_same_vocab(tokenizer, draft_tokenizer, target.cfg, draft.cfg)
    return draft


def load_draft_model(o: EngineOptions, device, backend: AttentionBackend) -> tuple[Transformer, Tokenizer]:
    """A draft model (from a path or built), quantized on its own if asked (fast/int4.py) and with
    a reduced vocabulary if asked (drafters/reduced_vocab.py: reduced first, then quantized)."""
    quantization, dtype = o.draft_quantization or o.quantization, draft_dtype(o)
    if o.draft_vocab_size is None:
        return load_model(o.draft_model, quantization, o, device, backend, dtype)
    draft, tokenizer = load_model(o.draft_model, None, o, device, backend, dtype)
    reduce_to_frequent(draft, tokenizer, o.draft_vocab_size)
    return (quantize_int4_model(draft) if quantization == "int4" else draft), tokenizer


def make_drafter(o: EngineOptions, target: Transformer, draft_runner: ModelRunner | None) -> Drafter | None:
    """The drafter the options name (None: plain decoding), with prompt lookup in front if asked."""
    chain_threshold = None if o.draft_tree_budget is not None else o.draft_confidence_threshold  # a tree's is its own
    if draft_runner is not None and isinstance(draft_runner.model, EagleModel):
        drafter = EagleDrafter(draft_runner, chain_threshold)
    elif draft_runner is not None:
        drafter = ModelDrafter(draft_runner, chain_threshold, target.cfg.vocab_size)
    elif o.uses_ngram:
        return NgramDrafter(o.ngram_max, o.ngram_min)
    else:
        return None
    if o.draft_tree_budget is not None:
        drafter = TreeDrafter(drafter, o.draft_tree_budget, o.draft_tree_top_k, o.draft_confidence_threshold)
    return drafter if o.prompt_lookup_min is None else LookupFirstDrafter(drafter, o.prompt_lookup_min, o.ngram_max)


def context_length(o: EngineOptions, target: Transformer) -> int:
    """The longest sequence (prompt + output): the target's context, or max_model_len (never longer)."""
    if o.max_model_len is not None and o.max_model_len > target.cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {o.max_model_len} is longer than the target's context "
                         f"(max_position_embeddings {target.cfg.max_position_embeddings})")
    return o.max_model_len or target.cfg.max_position_embeddings


def kv_caches(o: EngineOptions, models: list) -> list[KVCache]:
    """One paged pool per model, the budget split in proportion to each model's KV bytes per token,
    and no more pages than max_num_seqs full-length sequences could ever use (with a draft tree's
    slots past the sequence)."""
    device = models[0].device
    budget = kv_budget(o.kv_cache_gib, o.gpu_memory_utilization, device)
    per_token = [KVCache.bytes_per_page(m.cfg, 1, m.dtype) for m in models]
    slack = tree_slots(o.draft_tree_budget, o.draft_tree_top_k, o.num_speculative_tokens) if o.draft_tree_budget else 0
    max_pages = o.max_num_seqs * -(-(context_length(o, models[0]) + slack) // o.page_size)
    allocator = CachingAllocator if o.enable_prefix_caching else PageAllocator  # (the first shares pages)
    return [KVCache.from_budget(m.cfg, int(budget * b / sum(per_token)), o.page_size, m.dtype, device, max_pages, allocator)
            for m, b in zip(models, per_token)]


def kv_budget(kv_cache_gib: float | None, utilization: float, device: torch.device) -> int:
    """Bytes for all KV pools: kv_cache_gib, else a share of the free GPU memory, else 1 GiB on CPU."""
    if kv_cache_gib is not None:
        return int(kv_cache_gib * 2**30)
    if device.type == "cuda":
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * utilization)
    return 2**30


def use_cuda_graphs(o: EngineOptions, models: list) -> bool:
    """Graphs by default on CUDA, for models on the Triton kernels only: the torch twins and the
    batch-invariant backend (a quantized model's) plan each forward's attention on the host from
    its metadata, and a graph would freeze the plan of its capture, attending wrongly ever after."""
    on_cuda = models[0].device.type == "cuda"
    if o.cuda_graphs and not on_cuda:
        raise ValueError("cuda_graphs=True needs a CUDA device (static_shapes=True runs the same layout eagerly)")
    graphs = on_cuda if o.cuda_graphs is None else bool(o.cuda_graphs)
    planned = sorted({m.backend.name for m in models} - {"triton"})
    if graphs and planned:
        if o.cuda_graphs:
            raise ValueError(f"cuda_graphs=True needs the Triton kernels, but the {' and '.join(planned)} attention "
                             "backend plans each forward on the host (a quantized model runs the invariant one); "
                             "use static_shapes=True or leave cuda_graphs unset")
        return False
    return graphs


def check_built(model, quantization: str | None, what: str):
    """A model passed already built: it must carry the quantization asked for (never applied in place)."""
    have = model.quantization
    if quantization is not None and have != quantization:
        raise ValueError(f"quantization={quantization!r} but {what} was passed already built with "
                         f"{have or 'full-precision'} weights: load it with quantization={quantization!r} "
                         "(load_checkpoint, fast.int8.quantize_model) or pass its path")
    return model


def check_pair(o: EngineOptions) -> None:
    """A target and a draft model given as checkpoint paths are checked from their configs and
    tokenizers before either loads (minutes for a large pair): the same tokenizer (else an error),
    and a warning if the draft is not smaller than the target (it would cost more than it saves)."""
    paths = (o.model, o.draft_model)
    if not o.uses_model_drafter or not all(isinstance(p, (str, Path)) for p in paths) or is_eagle_checkpoint(o.draft_model):
        return
    (target_cfg, target_tok), (draft_cfg, draft_tok) = (peek_checkpoint(p) for p in paths)
    try:
        check_same_vocab(target_tok, draft_tok, target_cfg, draft_cfg)
    except ValueError as e:
        raise ValueError(f"draft_model {o.draft_model}: {e}") from None
    if draft_cfg.num_parameters >= target_cfg.num_parameters:
        warnings.warn(f"draft_model {o.draft_model} ({draft_cfg.num_parameters:,} parameters) is not smaller "
                      f"than the target {o.model} ({target_cfg.num_parameters:,}): each drafted token costs "
                      "about a target step, so speculation will be slower than plain decoding", stacklevel=3)


def check_same_vocab(target_tok: Tokenizer, draft_tok: Tokenizer, target: ModelConfig, draft: ModelConfig) -> None:
    """Speculative sampling compares p and q token by token: both models must share one
    tokenizer. Their embeddings may be padded to different sizes (Qwen2.5-0.5B: 151936 rows,
    Qwen2.5-7B: 152064) as long as both cover the tokenizer's whole vocabulary."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(f"draft tokenizer differs from the target's (e.g. {diff}); they must be identical")
    needed = max(tv.values(), default=-1) + 1  # ids the tokenizer can produce
    if min(target.vocab_size, draft.vocab_size) < needed:
        raise ValueError(
            f"draft model vocab_size {draft.vocab_size} and target vocab_size {target.vocab_size}: both must "
            f"cover the tokenizer's {needed} ids (the draft must use the target's tokenizer)"
        )

"""The public API, shaped like vLLM's:

    llm = LLM(model="path/to/target", draft_model="path/to/draft" | "ngram" | None, num_speculative_tokens=4)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.7, top_p=0.95, max_tokens=64, seed=0))
    outputs[0].text, outputs[0].token_ids, llm.last_metrics.summary()

`LLM.stream(...)` yields tokens per request as they are produced.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import AttentionBackend
from .drafters import ModelDrafter, NgramDrafter
from .eagle import EagleDrafter, EagleModel, is_eagle_checkpoint, load_eagle
from .engine import LLMEngine
from .kv_cache import KVCache
from .loader import load_checkpoint
from .metrics import RequestMetrics, RunMetrics
from .model import Transformer
from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence
from .tokenizer import Tokenizer


@dataclass
class RequestOutput:
    index: int  # position in the prompts list
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (EOS / the token completing a stop string included)
    text: str  # generated text, cut before a matched stop string
    finish_reason: str  # "length" | "eos" | "stop" | "abort"
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: log-prob}, if requested
    prompt: str | None = None  # the prompt text, when it was given as text

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM's shape: `output.outputs[0].text` (one completion per prompt here)."""
        return [self]


@dataclass
class StreamEvent:
    index: int
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, if requested


class LLM:
    def __init__(
        self,
        model: str | tuple[Transformer, Tokenizer],
        draft_model: str | tuple[Transformer, Tokenizer] | None = None,
        num_speculative_tokens: int | None = None,
        *,
        speculative_model: str | tuple[Transformer, Tokenizer] | None = None,
        speculative_config: dict | None = None,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype | None = "auto",
        device: str | None = None,
        backend: str | None = None,
        page_size: int = 16,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        ngram_max: int = 3,
        ngram_min: int = 1,
        draft_confidence_threshold: float | None = None,
        verbose: bool = False,
    ):
        """model / draft_model: an HF checkpoint dir, a .gguf file, or an already built
        (Transformer, Tokenizer) pair; draft_model="ngram" selects prompt-lookup drafting; an
        EAGLE-3 checkpoint dir (config.json with draft_vocab_size, see eagle.py) or a built
        EagleModel selects the feature drafter.
        kv_cache_gib: KV budget for both pools together (default: gpu_memory_utilization of the
        free GPU memory on CUDA, 1 GiB on CPU), split in proportion to per-token KV size.
        draft_confidence_threshold: adaptive draft length for a draft model; each step drafts up
        to num_speculative_tokens, stopping after a token the draft gave probability < threshold.
        vLLM spellings are accepted too: speculative_model= (older vLLM) for draft_model, and
        speculative_config={"model": ..., "num_speculative_tokens": ..., "method": "draft_model" |
        "ngram" | "eagle3"} (current vLLM); tensor_parallel_size must be 1 (one device)."""
        draft_model, num_speculative_tokens = vllm_spec_args(
            draft_model, num_speculative_tokens, speculative_model, speculative_config, tensor_parallel_size)
        if draft_model is not None and not (isinstance(num_speculative_tokens, int) and 1 <= num_speculative_tokens <= 32):
            raise ValueError(f"num_speculative_tokens must be an int in [1, 32], got {num_speculative_tokens!r}")
        if draft_confidence_threshold is not None and (draft_model is None or draft_model == "ngram"):
            raise ValueError("draft_confidence_threshold needs a draft model (the n-gram drafter has no probabilities)")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        backend = AttentionBackend(backend)
        target, self.tokenizer = self._load(model, dtype, device, backend)
        device_ = target.embed_tokens.weight.device
        draft = None
        if isinstance(draft_model, EagleModel):  # built for this target (see eagle.build_eagle)
            draft = draft_model
        elif isinstance(draft_model, (str, Path)) and draft_model != "ngram" and is_eagle_checkpoint(draft_model):
            draft = load_eagle(draft_model, target)
        elif draft_model is not None and draft_model != "ngram":
            draft, draft_tok = self._load(draft_model, dtype, device_, backend)
            check_same_vocab(self.tokenizer, draft_tok, target, draft)

        models = [target] + ([draft] if draft is not None else [])
        budget = self._kv_budget(kv_cache_gib, gpu_memory_utilization, device_)
        per_token = [KVCache.bytes_per_page(m.cfg, 1, m.lm_head.weight.dtype) for m in models]
        # No more pages than max_num_seqs full-length sequences could ever use.
        max_len = min(target.cfg.max_position_embeddings, max_model_len or target.cfg.max_position_embeddings)
        max_pages = max_num_seqs * -(-max_len // page_size)
        caches = [
            KVCache.from_budget(
                m.cfg, int(budget * b / sum(per_token)), page_size, m.lm_head.weight.dtype, device_, max_pages
            )
            for m, b in zip(models, per_token)
        ]
        runners = [ModelRunner(m, c) for m, c in zip(models, caches)]
        for r in runners:
            r.max_positions = min(r.max_positions, max_len)
        if isinstance(draft, EagleModel):
            drafter = EagleDrafter(runners[1], draft_confidence_threshold)
        elif draft is not None:
            drafter = ModelDrafter(runners[1], draft_confidence_threshold)
        elif draft_model == "ngram":
            drafter = NgramDrafter(ngram_max, ngram_min)
        else:
            drafter = None
        self.engine = LLMEngine(
            runners[0],
            self.tokenizer,
            drafter,
            runners[1] if draft is not None else None,
            num_speculative_tokens,
            max_num_seqs,
            max_num_batched_tokens,
        )
        self.last_metrics: RunMetrics | None = None
        if verbose:
            for name, c in zip(("target", "draft"), caches):
                print(
                    f"[minispec] {name} KV cache: {c.num_pages} pages x {page_size} tokens "
                    f"({c.nbytes / 2**30:.3f} GiB of a {budget / 2**30:.3f} GiB budget, "
                    f"{c.num_pages * page_size} tokens), backend={backend.name}",
                    file=sys.stderr,
                )

    @staticmethod
    def _load(model, dtype, device, backend) -> tuple[Transformer, Tokenizer]:
        if isinstance(model, tuple):
            return model
        return load_checkpoint(model, dtype=dtype, device=device, backend=backend)

    @staticmethod
    def _kv_budget(kv_cache_gib: float | None, utilization: float, device: torch.device) -> int:
        if kv_cache_gib is not None:
            if kv_cache_gib <= 0:
                raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
            return int(kv_cache_gib * 2**30)
        if device.type == "cuda":
            if not 0 < utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * utilization)
        return 2**30

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.engine.target.model.cfg.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        return list(prompt)

    def _submit(self, prompts, params) -> list[Sequence]:
        prompts = as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self._prompt_ids(p) for p in prompts]
        for i, p in zip(ids, params):  # validate all before queueing any
            self.engine.check_request(i, p)
        return [self.engine.add_request(i, p) for i, p in zip(ids, params)]

    def _run(self, seqs: list[Sequence]) -> Iterator[StreamEvent]:
        index = {s.request_id: i for i, s in enumerate(seqs)}
        self.engine.times.draft_s = self.engine.times.target_s = 0.0
        t0 = time.perf_counter()
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.new_token_ids or out.finished:
                        s, n = out.seq, len(out.new_token_ids)
                        logprobs = s.logprobs[len(s.logprobs) - n :] if s.params.logprobs is not None else None
                        yield StreamEvent(index[s.request_id], out.new_token_ids, out.finished, logprobs)
        finally:  # a stream abandoned midway must not leave its requests in the engine
            for s in seqs:
                if not s.finished:
                    self.engine.scheduler.abort(s)
        self.last_metrics = self.engine.run_metrics(seqs, time.perf_counter() - t0)

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield StreamEvent(index, new_token_ids, finished) as tokens are produced."""
        return self._run(self._submit(prompts, sampling_params))

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order.
        use_tqdm prints a progress line (requests done, tokens, tokens/s) to stderr."""
        prompts = as_prompt_list(prompts)
        seqs = self._submit(prompts, sampling_params)
        done, tokens, t0 = 0, 0, time.perf_counter()
        for event in self._run(seqs):
            done += event.finished
            tokens += len(event.new_token_ids)
            if use_tqdm:
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                print(f"\r[minispec] {done}/{len(seqs)} requests, {tokens} tokens, {rate:.1f} tok/s", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        return [self._output(i, s, p if isinstance(p, str) else None) for i, (s, p) in enumerate(zip(seqs, prompts))]

    def _output(self, index: int, s: Sequence, prompt: str | None = None) -> RequestOutput:
        text = self.tokenizer.decode(s.output_ids)
        if s.stop_text_end is not None:
            text = text[: s.stop_text_end]
        logprobs = list(s.logprobs) if s.params.logprobs is not None else None
        return RequestOutput(index, s.prompt_ids, list(s.output_ids), text, s.finish_reason, s.metrics, logprobs, prompt)


def vllm_spec_args(draft_model, num_speculative_tokens: int | None, speculative_model, speculative_config: dict | None,
                   tensor_parallel_size: int) -> tuple:
    """vLLM's ways of naming the drafter -> (draft_model, num_speculative_tokens; 4 by default)."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size must be 1 (minispec runs on one device), got {tensor_parallel_size!r}")
    given = [name for name, value in (("draft_model", draft_model), ("speculative_model", speculative_model),
                                      ("speculative_config", speculative_config)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"name the drafter once: got {' and '.join(given)}")
    if speculative_model is not None:
        draft_model = speculative_model
    if speculative_config is not None:
        if not isinstance(speculative_config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
        unknown = sorted(set(speculative_config) - {"method", "model", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config keys not supported: {unknown} (use method, model, num_speculative_tokens)")
        method, model = speculative_config.get("method"), speculative_config.get("model")
        if method == "ngram" or (method is None and model == "ngram"):
            draft_model = "ngram"
        elif method in (None, "draft_model", "eagle", "eagle3"):
            if model is None:
                raise ValueError("speculative_config needs 'model' (a draft checkpoint) unless method is 'ngram'")
            if method in ("eagle", "eagle3") and not (isinstance(model, EagleModel) or is_eagle_checkpoint(model)):
                raise ValueError(f"speculative_config method {method!r} needs an EAGLE-3 checkpoint (config.json with "
                                 f"draft_vocab_size); {model!r} is not one")
            draft_model = model
        else:
            raise ValueError(f"speculative_config method {method!r} is not supported (use 'draft_model', 'eagle3' or 'ngram')")
        config_k = speculative_config.get("num_speculative_tokens")
        if num_speculative_tokens is not None and config_k is not None and config_k != num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} disagrees with speculative_config's {config_k}")
        num_speculative_tokens = num_speculative_tokens if config_k is None else config_k
    return draft_model, 4 if num_speculative_tokens is None else num_speculative_tokens


def as_prompt_list(prompts) -> list:
    """One prompt (text or token ids) or a list of them -> a list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def check_same_vocab(target_tok: Tokenizer, draft_tok: Tokenizer, target: Transformer, draft: Transformer) -> None:
    """Speculative sampling compares p and q token by token: both models must share one vocabulary."""
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        raise ValueError(
            f"draft model vocab_size {draft.cfg.vocab_size} != target vocab_size {target.cfg.vocab_size}: "
            "the draft must use the target's tokenizer"
        )
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(f"draft tokenizer differs from the target's (e.g. {diff}); they must be identical")

"""The public API, shaped like vLLM's:

    llm = LLM(model="path/to/target", draft_model="path/to/draft" | "ngram" | None, num_speculative_tokens=4)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.7, top_p=0.95, max_tokens=64, seed=0))
    outputs[0].text, outputs[0].token_ids, llm.last_metrics.summary()

`LLM.stream(...)` yields tokens per request as they are produced.

Calls own their requests: a `generate` or `stream` sees only the requests it queued, and a stream
that is abandoned (closed, garbage-collected) takes its requests and their pages with it. One LLM
may be used from several threads: engine steps are serialised by a lock (each step advances every
queued request and hands each call its own tokens), so concurrent calls interleave their steps.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import AttentionBackend
from .drafters import ModelDrafter, NgramDrafter
from .eagle import EagleDrafter, EagleModel, is_eagle_checkpoint, load_eagle
from .engine import LLMEngine, StepOutput
from .hybrid import LookupFirstDrafter
from .kv_cache import KVCache
from .loader import load_checkpoint
from .metrics import RequestMetrics, RunMetrics
from .model import Transformer
from .quant import check_quantization, quantize_model
from .runner import ModelRunner
from .sampling import SamplingParams
from .sequence import Sequence
from .speculative import StepTimes
from .tokenizer import Tokenizer


@dataclass
class RequestOutput:
    index: int  # position in the prompts list
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (EOS / the token completing a stop string included)
    text: str  # generated text, cut before a matched stop string
    finish_reason: str  # "length" | "eos" | "stop" | "abort" | "error"
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: log-prob}, if requested
    prompt: str | None = None  # the prompt text, when it was given as text
    error: str | None = None  # what went wrong, when finish_reason is "error"

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM's shape: `output.outputs[0].text` (one completion per prompt here)."""
        return [self]


@dataclass
class StreamEvent:
    """New tokens of request `index` (its position in the call's prompts). `new_text` is the text
    they complete: text that may still change (a partial UTF-8 character, a possible start of a
    stop string) is held back until it cannot, and a matched stop string is never sent."""

    index: int
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, if requested
    new_text: str = ""
    finish_reason: str | None = None  # set on the request's last event (see RequestOutput)
    error: str | None = None
    # The step behind these tokens: the drafter proposed `drafted`, the target accepted the first
    # `num_accepted`; so new_token_ids[:num_accepted] are accepted drafts and the token after them
    # is the target's own (the replacement of the first rejected draft, or the bonus token). EOS or
    # a stop string may cut new_token_ids short of num_accepted + 1.
    drafted: list[int] = dataclasses.field(default_factory=list)
    num_accepted: int = 0


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
        quantization: str | None = None,
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
        prompt_lookup_min: int | None = None,
        cuda_graphs: bool | None = None,
        static_shapes: bool | None = None,
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
        prompt_lookup_min (with a draft model or EAGLE head): a sequence whose last n >= this many
        tokens occurred earlier in it drafts what followed that occurrence (prompt lookup, no
        forward; n up to max(ngram_max, this)); the model drafts for the others (hybrid.py).
        vLLM spellings are accepted too: speculative_model= (older vLLM) for draft_model, and
        speculative_config={"model": ..., "num_speculative_tokens": ..., "method": "draft_model" |
        "ngram" | "eagle3", "prompt_lookup_min": n, "prompt_lookup_max": n} (current vLLM; the
        window is the n-gram drafter's, or with a model prompt lookup in front of it, as
        prompt_lookup_min); tensor_parallel_size must be 1 (one device).
        cuda_graphs (default: on CUDA): decode, verification and draft steps run with static
        shapes, captured as CUDA graphs at start-up (graphs.py; a failed capture warns once and
        runs them eagerly). static_shapes (default: cuda_graphs) runs that static layout without
        graphs, e.g. on CPU, where it is what the tests compare with the dynamic path.
        quantization="int8": target and draft (model or EAGLE head) with int8 weights and dynamic
        per-row activation scales (quant.py); speculative output is exact for that int8 target.
        Models passed already built must have been loaded with it (load_checkpoint(...,
        quantization="int8"), quant.quantize_model): they are never quantized in place."""
        check_quantization(quantization)
        draft_model, num_speculative_tokens, lookup = vllm_spec_args(
            draft_model, num_speculative_tokens, speculative_model, speculative_config, tensor_parallel_size)
        if draft_model == "ngram":  # vLLM's n-gram window, from speculative_config
            ngram_min, ngram_max = lookup.get("prompt_lookup_min", ngram_min), lookup.get("prompt_lookup_max", ngram_max)
        elif lookup:  # prompt lookup in front of the model drafter
            if "prompt_lookup_min" not in lookup:
                raise ValueError("speculative_config's prompt_lookup_max with a draft model needs prompt_lookup_min "
                                 "(which puts prompt lookup in front of the model)")
            if prompt_lookup_min not in (None, lookup["prompt_lookup_min"]):
                raise ValueError(f"prompt_lookup_min={prompt_lookup_min} disagrees with speculative_config's "
                                 f"{lookup['prompt_lookup_min']}")
            prompt_lookup_min, ngram_max = lookup["prompt_lookup_min"], lookup.get("prompt_lookup_max", ngram_max)
        if draft_model is not None:
            check_int("num_speculative_tokens", num_speculative_tokens, 1, 32)
        if draft_confidence_threshold is not None and (draft_model is None or draft_model == "ngram"):
            raise ValueError("draft_confidence_threshold needs a draft model (the n-gram drafter has no probabilities)")
        if prompt_lookup_min is not None:
            check_int("prompt_lookup_min", prompt_lookup_min, 1)
            if draft_model is None or draft_model == "ngram":
                raise ValueError("prompt_lookup_min puts prompt lookup in front of a draft model or EAGLE head; "
                                 "give one as draft_model (the n-gram drafter alone takes ngram_min / ngram_max)")
        for name, value in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("ngram_max", ngram_max), ("ngram_min", ngram_min)):
            check_int(name, value, 1)
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, 1)
        for name, value in (("kv_cache_gib", kv_cache_gib), ("gpu_memory_utilization", gpu_memory_utilization)):
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        backend = AttentionBackend(backend)
        target, self.tokenizer = self._load(model, dtype, device, backend, quantization)
        device_ = target.embed_tokens.weight.device
        draft = None
        if isinstance(draft_model, EagleModel):  # built for this target (see eagle.build_eagle)
            draft = check_built(draft_model, quantization, "draft_model")
        elif isinstance(draft_model, (str, Path)) and draft_model != "ngram" and is_eagle_checkpoint(draft_model):
            draft = quantize_model(load_eagle(draft_model, target), quantization)
        elif draft_model is not None and draft_model != "ngram":
            draft, draft_tok = self._load(draft_model, dtype, device_, backend, quantization)
            check_same_vocab(self.tokenizer, draft_tok, target, draft)

        models = [target] + ([draft] if draft is not None else [])
        budget = self._kv_budget(kv_cache_gib, gpu_memory_utilization, device_)
        per_token = [KVCache.bytes_per_page(m.cfg, 1, m.dtype) for m in models]
        # No more pages than max_num_seqs full-length sequences could ever use.
        max_len = min(target.cfg.max_position_embeddings, max_model_len or target.cfg.max_position_embeddings)
        max_pages = max_num_seqs * -(-max_len // page_size)
        caches = [
            KVCache.from_budget(
                m.cfg, int(budget * b / sum(per_token)), page_size, m.dtype, device_, max_pages
            )
            for m, b in zip(models, per_token)
        ]
        runners = [ModelRunner(m, c) for m, c in zip(models, caches)]
        for r in runners:
            r.max_positions = min(r.max_positions, max_len)
        if isinstance(draft, EagleModel):
            drafter = EagleDrafter(runners[1], draft_confidence_threshold)
        elif draft is not None:
            drafter = ModelDrafter(runners[1], draft_confidence_threshold, target.cfg.vocab_size)
        elif draft_model == "ngram":
            drafter = NgramDrafter(ngram_max, ngram_min)
        else:
            drafter = None
        if prompt_lookup_min is not None:
            drafter = LookupFirstDrafter(drafter, prompt_lookup_min, ngram_max)
        on_cuda = device_.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs=True needs a CUDA device (static_shapes=True runs the same layout eagerly)")
        graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        invariant = [m for m in models if getattr(m.backend, "name", None) == "invariant"]
        if invariant and graphs:  # its attention plans are built in Python per forward: a graph would freeze one
            if cuda_graphs:
                raise ValueError("cuda_graphs=True cannot run a quantized model (its batch-invariant attention "
                                 "plans each forward in Python); use static_shapes=True or leave cuda_graphs unset")
            graphs = False
        self.engine = LLMEngine(
            runners[0],
            self.tokenizer,
            drafter,
            runners[1] if draft is not None else None,
            num_speculative_tokens,
            max_num_seqs,
            max_num_batched_tokens,
        )
        if static_shapes if static_shapes is not None else graphs:
            layers = getattr(drafter, "target_layers", None)  # a feature drafter's (maybe behind lookup)
            target_args = {"hidden_layers": layers} if layers is not None else {}
            runners[0].use_static_shapes(self.engine.k + 1, max_num_seqs, graphs, **target_args)
            # A draft model's steps feed 1 token (2 after a fully accepted step; more after steps
            # prompt lookup drafted, which run eagerly: static shapes fit the common case).
            if isinstance(getattr(drafter, "model_drafter", drafter), ModelDrafter):
                runners[1].use_static_shapes(2, max_num_seqs, graphs)
        self.last_metrics: RunMetrics | None = None
        self._lock = threading.RLock()  # one engine step, submission or abort at a time
        self._owners: dict[int, _Call] = {}  # request_id -> the call that queued it (until it finishes)
        self._stepping = False
        self._closed_while_stepping: list[_Call] = []
        if verbose:
            for name, c in zip(("target", "draft"), caches):
                print(
                    f"[minispec] {name} KV cache: {c.num_pages} pages x {page_size} tokens "
                    f"({c.nbytes / 2**30:.3f} GiB of a {budget / 2**30:.3f} GiB budget, "
                    f"{c.num_pages * page_size} tokens), backend={getattr(target.backend, 'name', target.backend)}",
                    file=sys.stderr,
                )

    @staticmethod
    def _load(model, dtype, device, backend, quantization) -> tuple[Transformer, Tokenizer]:
        if isinstance(model, tuple):
            return check_built(model[0], quantization, "a model"), model[1]
        return load_checkpoint(model, dtype=dtype, device=device, backend=backend, quantization=quantization)

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

    def _prompt_ids(self, prompt) -> list[int]:
        """One prompt -> token ids: text, token ids (ints in the vocabulary), or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids} dicts."""
        if isinstance(prompt, dict):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise ValueError(f"a dict prompt needs exactly one of 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            prompt = prompt[keys.pop()]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list):
            raise TypeError(f"a prompt must be a str, a list of int token ids or a vLLM prompt dict, got "
                            f"{type(prompt).__name__}" + (" (convert it with .tolist())" if hasattr(prompt, "tolist") else ""))
        vocab = self.engine.target.model.cfg.vocab_size
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {prompt[:8]!r}"
                             + (" ..." if len(prompt) > 8 else ""))
        return [int(t) for t in prompt]

    def _requests(self, prompts, params) -> list[tuple[list[int], SamplingParams]]:
        """Validated (token ids, params) per prompt; raises before anything is queued."""
        prompts = as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams (or a list of them), got {type(p).__name__}")
            p.validate()  # again: fields may have been changed since construction
        ids = [self._prompt_ids(p) for p in prompts]
        for i, p in zip(ids, params):
            self.engine.check_request(i, p)
        return list(zip(ids, params))

    def _start(self, requests: list[tuple[list[int], SamplingParams]], with_text: bool) -> _Call:
        """Queue all of a call's requests (or none: see LLMEngine.add_requests)."""
        with self._lock:
            call = _Call(self.engine.add_requests(requests), with_text, self.engine.times)
            for s in call.seqs:
                self._owners[s.request_id] = call
        return call

    def _events(self, call: _Call) -> Iterator[StreamEvent]:
        """The call's events in order. Each engine step advances every queued request, whoever
        made it; events of other calls' requests wait in those calls' queues."""
        try:
            while True:
                with self._lock:
                    if not call.events:
                        if all(s.finished for s in call.seqs):
                            return
                        self._step()
                        continue
                    event = call.events.popleft()
                yield event
        finally:  # run to the end, closed, abandoned or garbage-collected: its requests leave the engine
            self._close(call)

    def _step(self) -> None:
        """One engine step (lock held); outputs go to the calls that own them. Streams collected
        meanwhile are closed after it. Should the step raise, every request in the engine ends
        with finish_reason "error" (their pages freed, their owners told), then it re-raises."""
        self._stepping = True
        try:
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._fail_all(f"{type(e).__name__}: {e}")
                raise
            for out in outputs:
                call = self._owners.get(out.seq.request_id)
                if call is not None and (out.new_token_ids or out.finished):
                    call.add_event(out, self.tokenizer)
                if out.finished:
                    self._owners.pop(out.seq.request_id, None)
        finally:
            self._stepping = False
            closed, self._closed_while_stepping = self._closed_while_stepping, []
            for call in closed:
                self._close(call)

    def _fail_all(self, message: str) -> None:
        """End every queued or running request with finish_reason "error" (the engine's state
        after a failed step is not trusted)."""
        scheduler = self.engine.scheduler
        for seq in list(scheduler.running) + list(scheduler.waiting):
            scheduler.abort(seq)
            seq.finish_reason, seq.error = "error", f"the engine step failed: {message}"
            call = self._owners.pop(seq.request_id, None)
            if call is not None:
                call.events.append(StreamEvent(call.index[seq.request_id], [], True, None, "", "error", seq.error))

    def _close(self, call: _Call) -> None:
        """Abort the call's unfinished requests (their pages are freed) and record its metrics."""
        with self._lock:
            if self._stepping:  # a stream collected by the garbage collector inside a step: after it
                self._closed_while_stepping.append(call)
                return
            completed = all(s.finished for s in call.seqs)
            for s in call.seqs:
                if not s.finished:
                    self.engine.scheduler.abort(s)
                self._owners.pop(s.request_id, None)
            if completed:  # (a stream dropped midway leaves the last completed call's metrics)
                self.last_metrics = self.engine.run_metrics(call.seqs, time.perf_counter() - call.t0, call.times_at_start)

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield StreamEvents (new tokens, their text, finished) as tokens are produced.

        Bad input raises here; the requests are queued when iteration starts, and leave the
        engine (pages freed) when the stream ends, is closed or is garbage-collected. Other calls
        made while this stream is paused keep its requests running and its events queued for it."""
        requests = self._requests(prompts, sampling_params)

        def events() -> Iterator[StreamEvent]:
            yield from self._events(self._start(requests, with_text=True))

        return events()

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order.
        use_tqdm prints a progress line (requests done, tokens, tokens/s) to stderr."""
        prompts = as_prompt_list(prompts)
        call = self._start(self._requests(prompts, sampling_params), with_text=False)
        done, tokens, t0 = 0, 0, time.perf_counter()
        for event in self._events(call):
            done += event.finished
            tokens += len(event.new_token_ids)
            if use_tqdm:
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                print(f"\r[minispec] {done}/{len(call.seqs)} requests, {tokens} tokens, {rate:.1f} tok/s", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        texts = [p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None for p in prompts]
        return [self._output(i, s, text) for i, (s, text) in enumerate(zip(call.seqs, texts))]

    def _output(self, index: int, s: Sequence, prompt: str | None = None) -> RequestOutput:
        logprobs = list(s.logprobs) if s.params.logprobs is not None else None
        return RequestOutput(index, s.prompt_ids, list(s.output_ids), output_text(s, self.tokenizer), s.finish_reason,
                             s.metrics, logprobs, prompt, s.error)


class _Call:
    """One generate / stream call: its sequences, in prompt order, and their events not yet yielded."""

    def __init__(self, seqs: list[Sequence], with_text: bool, times: StepTimes):
        self.seqs = seqs
        self.index = {s.request_id: i for i, s in enumerate(seqs)}
        self.events: deque[StreamEvent] = deque()
        self.with_text = with_text  # streams carry text; generate decodes once at the end
        self.text_sent = [0] * len(seqs)  # characters of each request's text already in events
        self.t0 = time.perf_counter()
        self.times_at_start = dataclasses.replace(times)  # the engine's cumulative times, copied

    def add_event(self, out: StepOutput, tokenizer: Tokenizer) -> None:
        s, new_ids, finished = out.seq, out.new_token_ids, out.finished
        i, n = self.index[s.request_id], len(new_ids)
        logprobs = s.logprobs[len(s.logprobs) - n :] if s.params.logprobs is not None and n else None
        text = ""
        if self.with_text:
            full = output_text(s, tokenizer)
            end = len(full)
            if not finished:  # hold back what may still change: a partial UTF-8 character, a stop string's start
                end = len(full.rstrip("\ufffd"))
                if s.params.stop:
                    end = min(end, len(full) - max(map(len, s.params.stop)) + 1)
            text, self.text_sent[i] = full[self.text_sent[i] : end], max(self.text_sent[i], end)
        self.events.append(StreamEvent(i, new_ids, finished, logprobs, text, s.finish_reason if finished else None,
                                       s.error if finished else None, out.drafted, out.num_accepted))


def check_built(model, quantization: str | None, what: str):
    """A model passed already built: it must carry the quantization asked for (never applied in place)."""
    have = getattr(model, "quantization", None)
    if quantization is not None and have != quantization:
        raise ValueError(f"quantization={quantization!r} but {what} was passed already built with "
                         f"{have or 'full-precision'} weights: load it with quantization={quantization!r} "
                         "(load_checkpoint, quant.quantize_model) or pass its path")
    return model


def output_text(s: Sequence, tokenizer: Tokenizer) -> str:
    """The request's output text, cut before a matched stop string."""
    text = tokenizer.decode(s.output_ids)
    return text if s.stop_text_end is None else text[: s.stop_text_end]


def vllm_spec_args(draft_model, num_speculative_tokens: int | None, speculative_model, speculative_config: dict | None,
                   tensor_parallel_size: int) -> tuple:
    """vLLM's ways of naming the drafter -> (draft_model, num_speculative_tokens (4 by default),
    the prompt lookup window speculative_config gives: {"prompt_lookup_min": n, "prompt_lookup_max": n},
    either key, or none)."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size must be 1 (minispec runs on one device), got {tensor_parallel_size!r}")
    given = [name for name, value in (("draft_model", draft_model), ("speculative_model", speculative_model),
                                      ("speculative_config", speculative_config)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"name the drafter once: got {' and '.join(given)}")
    if speculative_model is not None:
        draft_model = speculative_model
    lookup = {}
    if speculative_config is not None:
        if not isinstance(speculative_config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
        window = ("prompt_lookup_min", "prompt_lookup_max")
        unknown = sorted(set(speculative_config) - {"method", "model", "num_speculative_tokens", *window})
        if unknown:
            raise ValueError(f"speculative_config keys not supported: {unknown} "
                             "(use method, model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)")
        lookup = {key: speculative_config[key] for key in window if speculative_config.get(key) is not None}
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
    return draft_model, 4 if num_speculative_tokens is None else num_speculative_tokens, lookup


def check_int(name: str, value, low: int, high: int | None = None) -> None:
    """A ValueError naming the argument unless value is an int (not a bool) in [low, high]."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)):
        raise ValueError(f"{name} must be an int in [{low}, {high if high is not None else 'inf'}], got {value!r}")


def as_prompt_list(prompts) -> list:
    """One prompt (text, token ids, a vLLM prompt dict) or an iterable of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, bytearray, numbers.Number)) or not isinstance(prompts, Iterable) \
            or hasattr(prompts, "tolist"):
        raise TypeError(f"prompts must be a str, a list of int token ids, a vLLM prompt dict, or a list of these; "
                        f"got {type(prompts).__name__}" + (" (convert it with .tolist())" if hasattr(prompts, "tolist") else ""))
    return list(prompts)


def check_same_vocab(target_tok: Tokenizer, draft_tok: Tokenizer, target: Transformer, draft: Transformer) -> None:
    """Speculative sampling compares p and q token by token: both models must share one
    tokenizer. Their embeddings may be padded to different sizes (Qwen2.5-0.5B: 151936 rows,
    Qwen2.5-7B: 152064) as long as both cover the tokenizer's whole vocabulary."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(f"draft tokenizer differs from the target's (e.g. {diff}); they must be identical")
    needed = max(tv.values(), default=-1) + 1  # ids the tokenizer can produce
    if min(target.cfg.vocab_size, draft.cfg.vocab_size) < needed:
        raise ValueError(
            f"draft model vocab_size {draft.cfg.vocab_size} and target vocab_size {target.cfg.vocab_size}: both must "
            f"cover the tokenizer's {needed} ids (the draft must use the target's tokenizer)"
        )

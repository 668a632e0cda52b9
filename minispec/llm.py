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
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator

from .build import build_engine
from .engine import StepOutput
from .io.tokenizer import CONTEXT_TOKENS, Tokenizer
from .model.eagle import EagleModel
from .options import EngineOptions, Model
from .outputs import CompletionOutput, Logprob, RequestOutput, StreamEvent
from .prompts import Request, call_requests, conversations
from .runtime.detokenizer import output_text
from .runtime.metrics import RunMetrics, StepTimes
from .runtime.sequence import Sequence
from .sampling import SamplingParams


class LLM:
    def __init__(self, model: Model, draft_model: Model | EagleModel | None = None,
                 num_speculative_tokens: int | None = None, **options):
        """model: the target (an HF checkpoint dir, a .gguf file, or a built (Transformer,
        Tokenizer) pair); draft_model: a draft model, an EAGLE-3 head, "ngram", or None for plain
        decoding; num_speculative_tokens: k. Every other option, and vLLM's spellings of these,
        is an `EngineOptions` field (options.py), validated before anything is loaded."""
        self.options = EngineOptions(model, draft_model, num_speculative_tokens, **options)
        self.engine, self.tokenizer = build_engine(self.options)
        self.last_metrics: RunMetrics | None = None
        self._lock = threading.RLock()  # one engine step, submission or abort at a time
        self._owners: dict[int, _Call] = {}  # request_id -> the call that queued it (until it finishes)
        self._stepping = False
        self._closed_while_stepping: list[_Call] = []

    def _start(self, requests: list[Request], with_text: bool) -> _Call:
        """Queue all of a call's requests (or none: see LLMEngine.add_requests) and own them. An
        interrupt between the two leaves requests that no call owns: they are aborted here, and
        any left by a harder stop are aborted before the next step (`_abort_orphans`)."""
        with self._lock:
            seqs = []
            try:
                seqs = self.engine.add_requests([(r.token_ids, r.params) for r in requests])
                call = _Call(seqs, [(r.prompt_index, r.completion) for r in requests], with_text, self.engine.times)
                for s in call.seqs:
                    self._owners[s.request_id] = call
            except BaseException:
                for s in seqs:  # (some may be owned already, by a call nobody holds)
                    self._owners.pop(s.request_id, None)
                self._abort_orphans()
                raise
        return call

    def _abort_orphans(self) -> None:
        """Abort queued or running requests that no call owns (their pages are freed)."""
        scheduler = self.engine.scheduler
        for seq in list(scheduler.running) + list(scheduler.waiting):
            if seq.request_id not in self._owners:
                scheduler.abort(seq)

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

    def _step(self) -> int:
        """One engine step (lock held); outputs go to the calls that own them. Streams collected
        meanwhile are closed after it. Should the step raise, every request in the engine ends
        with finish_reason "error" (their pages freed, their owners told), then it re-raises. That
        includes a KeyboardInterrupt: a step stopped half-way (drafts verified, not yet rolled back;
        tokens emitted for some sequences, not others) leaves no state worth keeping."""
        self._stepping = True
        try:
            try:
                self._abort_orphans()
                outputs = self.engine.step()
                for out in outputs:
                    call = self._owners.get(out.seq.request_id)
                    if call is not None and (out.new_token_ids or out.finished):
                        call.add_event(out, self.tokenizer)
                    if out.finished:
                        self._owners.pop(out.seq.request_id, None)
            except BaseException as e:
                self._fail_all(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                raise
        finally:
            self._stepping = False
            closed, self._closed_while_stepping = self._closed_while_stepping, []
            for call in closed:
                self._close(call)
        return len(outputs)

    def _fail_all(self, message: str) -> None:
        """End every queued or running request with finish_reason "error" (the engine's state
        after a failed step is not trusted)."""
        scheduler = self.engine.scheduler
        for seq in list(scheduler.running) + list(scheduler.waiting):
            scheduler.abort(seq)
            seq.finish_reason, seq.error = "error", f"the engine step failed: {message}"
            call = self._owners.pop(seq.request_id, None)
            if call is not None:
                (i, j), k, text = call.index[seq.request_id], call.position[seq.request_id], ""
                if call.with_text:  # what was held back (a stop string's possible start, ...) of the tokens sent
                    full = self.tokenizer.decode_after(seq.prompt_ids, seq.output_ids[: call.ids_sent[k]])
                    text, call.text_sent[k] = full[call.text_sent[k] :], len(full)
                call.events.append(StreamEvent(i, [], True, None, text, "error", seq.error, completion_index=j))

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
        requests = call_requests(prompts, sampling_params, self.tokenizer, self.engine)

        def events() -> Iterator[StreamEvent]:
            yield from self._events(self._start(requests, with_text=True))

        return events()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order, each with its
        `n` completions. use_tqdm (default: on for more than one prompt, as vLLM) prints one
        progress line (requests done, tokens, tokens/s) to stderr."""
        requests = call_requests(prompts, sampling_params, self.tokenizer, self.engine)  # prompts.py
        call = self._start(requests, with_text=False)  # queued in the engine
        num_prompts = requests[-1].prompt_index + 1 if requests else 0
        show = num_prompts > 1 if use_tqdm is None else use_tqdm
        done, tokens, t0 = 0, 0, time.perf_counter()
        for event in self._events(call):  # the engine steps until the call's requests finish
            done += event.finished
            tokens += len(event.new_token_ids)
            if show:
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                print(f"\r[minispec] {done}/{len(call.seqs)} requests, {tokens} tokens, {rate:.1f} tok/s", end="", file=sys.stderr)
        if show:
            print(file=sys.stderr)
        by_prompt, texts = [[] for _ in range(num_prompts)], [None] * num_prompts
        for s, r in zip(call.seqs, requests):
            by_prompt[r.prompt_index].append(s)
            texts[r.prompt_index] = r.text
        return [self._output(seqs, text) for seqs, text in zip(by_prompt, texts)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `chat`: one conversation (a list of {"role", "content"} messages; content a string
        or text parts) or a list of them, each rendered with the target's chat template
        (add_generation_prompt: end with the assistant's turn opening) and generated; one
        RequestOutput per conversation."""
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations(messages)]
        outputs = self.generate([{"prompt_token_ids": self.tokenizer.chat_ids(t)} for t in texts], sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text  # the text the ids came from
        return outputs

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # --- for a server's engine loop: calls whose events another thread steps and collects --------

    def submit(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> _Call:
        """Queue a call's requests now (bad input raises here); its StreamEvents collect in
        `call.events` as `step_once` runs (from any thread). `close(call)` ends it early."""
        return self._start(call_requests(prompts, sampling_params, self.tokenizer, self.engine), with_text=True)

    def step_once(self) -> int:
        """One engine step for every queued request, if there is any. Returns how many sequences
        it advanced (0: nothing to do)."""
        with self._lock:
            if not self.engine.has_unfinished():
                return 0
            return self._step()

    def drain(self, call: _Call) -> tuple[list[StreamEvent], bool]:
        """The call's events so far (taken), and whether all its requests have finished."""
        with self._lock:
            events = list(call.events)
            call.events.clear()
            return events, all(s.finished for s in call.seqs)

    def close(self, call: _Call) -> None:
        """Abort the call's unfinished requests (their pages are freed)."""
        self._close(call)

    def _output(self, seqs: list[Sequence], prompt: str | None = None) -> RequestOutput:
        """A prompt's RequestOutput: its completions in order (their metrics are the first's)."""
        completions = []
        for j, s in enumerate(seqs):
            logprobs = decoded(s, 0, self.tokenizer) if s.params.logprobs is not None else None
            cumulative = sum(entry[t].logprob for t, entry in zip(s.output_ids, logprobs)) if logprobs is not None else None
            completions.append(CompletionOutput(j, output_text(s, self.tokenizer), list(s.output_ids), cumulative, logprobs,
                                                s.finish_reason, s.stop_reason))
        first = seqs[0]
        error = next((s.error for s in seqs if s.error), None)
        return RequestOutput(str(first.request_id), prompt, list(first.prompt_ids), None, completions,
                             all(s.finished for s in seqs), first.metrics, error)


class _Call:
    """One generate / stream call: its sequences, in prompt order (n per prompt), and their events
    not yet yielded."""

    def __init__(self, seqs: list[Sequence], slots: list[tuple[int, int]], with_text: bool, times: StepTimes):
        self.seqs = seqs
        self.slots = slots  # per sequence: (prompt index, completion index)
        self.index = {s.request_id: slot for s, slot in zip(seqs, slots)}
        self.position = {s.request_id: k for k, s in enumerate(seqs)}
        self.events: deque[StreamEvent] = deque()
        self.with_text = with_text  # streams carry text; generate decodes once at the end
        self.text_sent = [0] * len(seqs)  # characters of each request's text already in events
        self.ids_sent = [0] * len(seqs)  # ... and its tokens
        self.t0 = time.perf_counter()
        self.times_at_start = dataclasses.replace(times)  # the engine's cumulative times, copied

    def add_event(self, out: StepOutput, tokenizer: Tokenizer) -> None:
        s, new_ids, finished = out.seq, out.new_token_ids, out.finished
        (i, j), k, n = self.index[s.request_id], self.position[s.request_id], len(new_ids)
        self.ids_sent[k] += n
        logprobs = decoded(s, len(s.logprobs) - n, tokenizer) if s.params.logprobs is not None and n else None
        text = ""
        if self.with_text:
            full = output_text(s, tokenizer)
            end = len(full)
            if not finished:  # hold back what may still change: a partial UTF-8 character, a stop string's start
                end = len(full.rstrip("\ufffd"))  # (counted before it: the U+FFFD are no characters yet)
                if s.params.stop:  # (never below what was sent: the output may be shorter than a stop string)
                    end -= max(map(len, s.params.stop)) - 1
            end = max(end, self.text_sent[k])
            text, self.text_sent[k] = full[self.text_sent[k] : end], end
        self.events.append(StreamEvent(i, new_ids, finished, logprobs, text, s.finish_reason if finished else None,
                                       s.error if finished else None, s.stop_reason if finished else None,
                                       out.drafted, out.num_accepted, j, s.metrics if finished else None, out.num_drafted))


def decoded(s: Sequence, start: int, tokenizer: Tokenizer) -> list[dict[int, Logprob]]:
    """s.logprobs[start:] with each Logprob's decoded_token filled in (in place): each candidate
    as it would read after the tokens before its position."""
    entries, tokens = s.logprobs[start:], s.tokens
    for i, entry in enumerate(entries, len(s.prompt_ids) + start):
        missing = [token for token, lp in entry.items() if lp.decoded_token is None]
        texts = tokenizer.decode_each_after(tokens[max(0, i - CONTEXT_TOKENS) : i], [[t] for t in missing], skip_special_tokens=False)
        for token, text in zip(missing, texts):
            entry[token].decoded_token = text
    return entries

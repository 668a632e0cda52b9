"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

A request body becomes (prompts, SamplingParams, flags) or an `ApiError` naming the field, in
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`. A field minispec cannot
honour is refused by name, unless its value is the no-op default that clients send anyway.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..prompts import conversation
from ..sampling import SamplingParams

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
          "user", "include_stop_str_in_output", "pathwise"}
COMPLETION = COMMON | {"prompt", "logprobs"}
CHAT = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt"}
NO_OP = {"echo": (False, None), "best_of": (1, None), "suffix": (None, ""), "user": None, "logit_bias": (None, {}),
         "parallel_tool_calls": None, "tools": (None, []), "tool_choice": (None, "none"),
         "response_format": (None, {"type": "text"})}  # plain text only: a JSON format asked for is refused by name
MAX_N = 16
MAX_LOGPROBS = 20


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Parsed:
    prompts: list
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top logprobs per token (None: none asked)
    chat: bool


def check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NO_OP and (NO_OP[key] is None or value in NO_OP[key]):
            continue  # a default clients send anyway
        raise ApiError(f"'{key}' is not supported by this server", key)


def flag(body: dict, key: str, default: bool = False) -> bool:
    """A boolean field (absent or null: the default); a string such as "false" is a 400, not True."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(f"'{key}' must be a boolean, got {value!r}", key)
    return default if value is None else value


def number(body: dict, key: str, kind, default, low=None, high=None):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not isinstance(value, bool) if kind is not float else (
        isinstance(value, (int, float)) and not isinstance(value, bool))
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" in [{low}, {high}]" if high is not None else (f" >= {low}" if low is not None else "")
        raise ApiError(f"'{key}' must be a {'number' if kind is float else 'integer'}{bounds}, got {value!r}", key)
    return value


def sampling(body: dict, max_tokens_key: str, logprobs: int | None, context: int) -> SamplingParams:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise ApiError("'stop' must be a non-empty string or a list of up to 8 of them", "stop")
    max_tokens = number(body, max_tokens_key, int, None, 1, context)
    try:
        return SamplingParams(
            n=number(body, "n", int, 1, 1, MAX_N), temperature=number(body, "temperature", float, 1.0, 0, 2),
            top_p=number(body, "top_p", float, 1.0, 0, 1), top_k=number(body, "top_k", int, 0, -1),
            max_tokens=16 if max_tokens is None and max_tokens_key == "max_tokens" and "messages" not in body else max_tokens,
            min_tokens=number(body, "min_tokens", int, 0, 0), stop=stop, seed=number(body, "seed", int, None),
            presence_penalty=number(body, "presence_penalty", float, 0.0, -2, 2),
            frequency_penalty=number(body, "frequency_penalty", float, 0.0, -2, 2),
            repetition_penalty=number(body, "repetition_penalty", float, 1.0, 0.01, 10),
            stop_token_ids=body.get("stop_token_ids") or [], ignore_eos=flag(body, "ignore_eos"),
            include_stop_str_in_output=flag(body, "include_stop_str_in_output"), logprobs=logprobs,
            pathwise=flag(body, "pathwise", None))
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise ApiError(str(e), field) from None


def parse_completion(body: dict, context: int) -> Parsed:
    check_fields(body, COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p) for p in prompt):
        prompts = prompt
    else:
        raise ApiError("'prompt' must be a string, a list of token ids, or a non-empty list of these", "prompt")
    logprobs = number(body, "logprobs", int, None, 0, MAX_LOGPROBS)
    return Parsed(prompts, sampling(body, "max_tokens", logprobs, context), flag(body, "stream"),
                  include_usage(body), logprobs, chat=False)


def parse_chat(body: dict, context: int, render) -> Parsed:
    check_fields(body, CHAT)
    try:
        messages = conversation(body.get("messages"))
    except ValueError as e:
        raise ApiError(f"'messages': {e}", "messages") from None
    logprobs = number(body, "top_logprobs", int, 0, 0, MAX_LOGPROBS) if flag(body, "logprobs") else None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    prompt = render(messages, flag(body, "add_generation_prompt", True))
    return Parsed([prompt], sampling(body, key, logprobs, context), flag(body, "stream"), include_usage(body), logprobs,
                  chat=True)


def include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    return flag(options, "include_usage")


def usage(call, n: int, completion_tokens: int) -> dict:
    """OpenAI's usage object: the call's prompts counted once each (not once per completion)."""
    prompt_tokens = sum(len(s.prompt_ids) for s in call.seqs[::n])
    cached = sum(s.metrics.num_cached_tokens for s in call.seqs[::n])  # (found in the prefix cache)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def response_id(chat: bool) -> tuple[str, int]:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())


def logprobs_json(entries, tokens: list[int], chat: bool, top_n: int, offset: int = 0) -> dict:
    """OpenAI's logprobs object for a choice's tokens, from minispec's per-token {id: Logprob}.
    Completions' (legacy) shape, as vLLM fills it: each top_logprobs dict holds the top_n tokens
    and the sampled one, and text_offset the characters before each token (from `offset`: what
    the choice's earlier chunks held)."""
    def top(entry) -> list:
        return sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]

    if chat:
        return {"content": [{"token": e[t].decoded_token, "logprob": e[t].logprob,
                             "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob} for lp in top(e)]}
                            for t, e in zip(tokens, entries)]}
    texts, offsets = [e[t].decoded_token for t, e in zip(tokens, entries)], []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [e[t].logprob for t, e in zip(tokens, entries)],
            "top_logprobs": [{**{lp.decoded_token: lp.logprob for lp in top(e)}, e[t].decoded_token: e[t].logprob}
                             for t, e in zip(tokens, entries)],
            "text_offset": offsets}


def accumulate(choices: dict, event) -> None:
    c = choices.setdefault((event.index, event.completion_index), {"text": "", "tokens": [], "logprobs": [], "drafted": 0,
                                                                    "accepted": 0, "finish_reason": None, "stop_reason": None})
    c["text"] += event.new_text
    c["tokens"] += event.new_token_ids
    c["logprobs"] += event.new_logprobs or []
    c["drafted"] += event.num_drafted
    c["accepted"] += event.num_accepted
    if event.finished:
        c["finish_reason"], c["stop_reason"] = event.finish_reason, event.stop_reason
        if event.error:
            raise ApiError(f"the request failed: {event.error}", None, 500, "server_error")


def openai_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason: stop and length as they are; an aborted request stopped."""
    return {"abort": "stop"}.get(reason, reason)

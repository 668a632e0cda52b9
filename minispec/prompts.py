"""A call's prompts and SamplingParams -> the requests it queues: validated, each with its own copy
of the params, n per prompt. Prompts are vLLM's: text, token ids, or {"prompt": text} /
{"prompt_token_ids": ids} dicts, one or a list of them."""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Iterable

from .engine import LLMEngine
from .io.tokenizer import Tokenizer
from .sampling import SamplingParams


@dataclasses.dataclass
class Request:
    """One request a call queues: completion `completion` of prompt `prompt_index` (text: the
    prompt's text, when it was given as text)."""

    prompt_index: int
    completion: int
    token_ids: list[int]
    params: SamplingParams
    text: str | None


def call_requests(prompts, params, tokenizer: Tokenizer, engine: LLMEngine) -> list[Request]:
    """The call's validated requests, n per prompt (completion j of a seeded request seeded with
    seed + j); raises before anything is queued."""
    prompts = as_prompt_list(prompts)
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if isinstance(params, (dict, str)):  # (a dict would be read as its keys)
        raise TypeError(f"sampling_params must be SamplingParams (or a list of them), got a {type(params).__name__}; "
                        "for a dict of options: SamplingParams(**options)")
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams (or a list of them), got {type(p).__name__}")
    params = [copy.deepcopy(p) for p in params]  # each request its own: changing the caller's object later changes nothing
    for p in params:
        p.validate()  # again: fields may have been changed since construction
    ids = [prompt_ids(p, tokenizer, engine.target.model.cfg.vocab_size) for p in prompts]
    for i, p in zip(ids, params):
        if p.max_tokens is None:  # up to the context (and what the KV pools can hold)
            p.max_tokens = max(engine.max_new_tokens(len(i)), 1)
            p.validate()
        engine.check_request(i, p)
    texts = [p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None for p in prompts]
    return [Request(index, j, i, completion_params(p, j), text)
            for index, (i, p, text) in enumerate(zip(ids, params, texts)) for j in range(p.n)]


def prompt_ids(prompt, tokenizer: Tokenizer, vocab: int) -> list[int]:
    """One prompt -> token ids: text, token ids (ints in the vocabulary), or vLLM's
    {"prompt": text} / {"prompt_token_ids": ids} dicts."""
    if isinstance(prompt, dict):
        unsupported = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unsupported:
            raise ValueError(f"prompt dict keys not supported: {unsupported} (minispec takes 'prompt' or 'prompt_token_ids')")
        keys = set(prompt)
        if len(keys) != 1:
            raise ValueError(f"a dict prompt needs exactly one of 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        prompt = prompt[keys.pop()]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not isinstance(prompt, list):
        raise TypeError(f"a prompt must be a str, a list of int token ids or a vLLM prompt dict, got "
                        f"{type(prompt).__name__}" + (" (convert it with .tolist())" if hasattr(prompt, "tolist") else ""))
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {prompt[:8]!r}"
                         + (" ..." if len(prompt) > 8 else ""))
    return [int(t) for t in prompt]


def completion_params(params: SamplingParams, j: int) -> SamplingParams:
    """The params of completion j of a request with params.n completions: n = 1 and, when seeded,
    seed + j (wrapped into the seed range), so each completion is reproducible and they differ."""
    if params.n == 1:
        return params
    seed = params.seed
    if seed is not None:
        seed = seed + j if seed + j < 2**64 else seed + j - 2**64
    return dataclasses.replace(params, n=1, seed=seed)


def as_prompt_list(prompts) -> list:
    """One prompt (text, token ids, a vLLM prompt dict) or an iterable of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, bytearray, numbers.Number)) or not isinstance(prompts, Iterable) \
            or hasattr(prompts, "tolist"):
        raise TypeError(f"prompts must be a str, a list of int token ids, a vLLM prompt dict, or a list of these; "
                        f"got {type(prompts).__name__}" + (" (convert it with .tolist())" if hasattr(prompts, "tolist") else ""))
    return list(prompts)


def text_content(content) -> str | None:
    """A message's text: a string, or text parts joined by newlines (as vLLM joins them); None
    for anything else (an image part, say)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def conversations(messages) -> list[list[dict]]:
    """LLM.chat's input: one conversation or a list of them (`conversation`), or a ValueError."""
    return [conversation(c) for c in ([messages] if messages and isinstance(messages[0], dict) else list(messages))]


def conversation(messages) -> list[dict]:
    """A conversation (a non-empty list of {"role", "content"} messages, content a string or text
    parts: `text_content`) with string contents, or a ValueError saying what one is."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and text_content(m.get("content")) is not None
            for m in messages):
        raise ValueError("a conversation is a non-empty list of {'role': str, 'content': str or "
                         "[{'type': 'text', 'text': str}, ...]} messages")
    return [{**m, "content": text_content(m["content"])} for m in messages]

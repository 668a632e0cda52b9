"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer` with the special ids and chat template
a checkpoint declares (tokenizer.json, tokenizer_config.json, generation_config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ..model.config import as_id_list


CONTEXT_TOKENS = 5  # tokens before an output that `decode_after` renders it after (vLLM's prefix offset)


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        eos_token_ids: list[int],
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ):
        """bos_token / eos_token: the strings a chat template writes for them (tokenizer_config.json's;
        by default the tokens of bos_token_id and of the first EOS id)."""
        self.tok = tok
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self._compiled: tuple = (None, None)  # (the template, compiled): see compiled_template
        self.bos_token = bos_token if bos_token is not None else (tok.id_to_token(bos_token_id) or "" if bos_token_id is not None else "")
        self.eos_token = eos_token if eos_token is not None else (tok.id_to_token(eos_token_ids[0]) or "" if eos_token_ids else "")

    @classmethod
    def from_dir(cls, path: Path, hf_config: dict | None = None) -> "Tokenizer":
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{file} is not a readable tokenizer ({' '.join(str(e).split())[:200]})") from None
        tc = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_text(value) -> str | None:
            return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None  # {"content": "</s>", ...}

        def token_id(value) -> int | None:
            return None if token_text(value) is None else tok.token_to_id(token_text(value))

        # Every declared end, the tokenizer's own EOS first (what vLLM calls the EOS: stop_reason
        # None; the others end a request as its stop tokens do). Qwen2.5- and Llama-3-Instruct list
        # an end token only in generation_config.json, beside the one config.json names.
        eos_ids = [] if token_id(tc.get("eos_token")) is None else [token_id(tc.get("eos_token"))]
        eos_ids += as_id_list(gen.get("eos_token_id"), "generation_config.json eos_token_id")
        eos_ids += as_id_list((hf_config or {}).get("eos_token_id"), "config.json eos_token_id")
        eos_ids = list(dict.fromkeys(eos_ids))  # unique, in order
        bos = (hf_config or {}).get("bos_token_id", token_id(tc.get("bos_token")))
        return cls(tok, eos_ids, bos, tc.get("chat_template"), token_text(tc.get("bos_token")), token_text(tc.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_after(self, context: list[int], ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text `ids` add after `context` (the tokens before them), as vLLM's detokenizer renders
        output: decoded alone, a first token can read differently (SentencePiece decoders, Llama 2's
        and Mistral's, strip its leading space: '▁Paris' -> 'Paris'). So the last CONTEXT_TOKENS
        context tokens are decoded with and without `ids` and the difference kept; `ids` alone
        where the two do not share that start (a character split across the boundary)."""
        return self.decode_each_after(context, [ids], skip_special_tokens)[0]

    def decode_each_after(self, context: list[int], continuations: list[list[int]], skip_special_tokens: bool = True
                          ) -> list[str]:
        """`decode_after` for several continuations of one context (a position's logprob
        candidates), the context decoded once."""
        context = list(context[-CONTEXT_TOKENS:])
        before = self.decode(context, skip_special_tokens) if context else None
        while before is not None and before.endswith("\ufffd") and len(context) > 1:
            # A byte-fallback decoder (Llama 2, Mistral) replaces a whole run of byte tokens that does
            # not start on a character: a shorter context may start on one (if it still ends in
            # U+FFFD, the context's last character is incomplete and the ids are decoded alone)
            context = context[1:]
            before = self.decode(context, skip_special_tokens)
        texts = []
        for ids in continuations:
            full = self.decode(context + list(ids), skip_special_tokens) if before is not None and ids else None
            kept = full is not None and full.startswith(before) and not before.endswith("\ufffd")
            texts.append(full[len(before):] if kept else self.decode(ids, skip_special_tokens))
        return texts

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> dict:
        """A conversation as a prompt: {"prompt_token_ids"} of its rendered template (`chat_ids`)."""
        return {"prompt_token_ids": self.chat_ids(self.apply_chat_template(messages, add_generation_prompt))}

    def chat_ids(self, rendered: str) -> list[int]:
        """A rendered chat's token ids, tokenized as it stands: the template writes BOS and every
        turn's EOS itself, so no special token is added (transformers' and vLLM's chat)."""
        return self.encode(rendered, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a chat with the checkpoint's Jinja template (the same one transformers uses), with
        the tokenizer's bos_token / eos_token strings."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass plain-text prompts")
        return self.compiled_template().render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token
        )

    def compiled_template(self):
        """The chat template compiled once (a render is then ~20x cheaper), again if it was changed."""
        if self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, compile_chat_template(self.chat_template))
        return self._compiled[1]


def compile_chat_template(template: str):
    """A chat template compiled as transformers compiles it: sandboxed (a template comes with a
    downloaded checkpoint), with {% break %} / {% continue %}, its raise_exception and its tojson
    (no HTML escaping)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):  # what HF's templates call to refuse a conversation
        raise ValueError(f"the chat template refuses this conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    """A JSON object file's contents ({} when there is no such file), or a ValueError naming it."""
    return read_json_object(path) if path.exists() else {}


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`, or a ValueError naming the file and what is wrong with it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value

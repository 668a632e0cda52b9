"""The `minispec` command (also `python -m minispec`): watch speculative decoding happen.

    minispec generate "Write a Python function that reverses a string."
    minispec generate --prompts prompts.txt --draft ngram -k 6 --trace run.html
    minispec chat --temperature 0.7 --top-p 0.95

On a terminal each emitted token is coloured by where it came from (terminal.py). After each
answer one line on stderr: tokens, why it stopped, time to first token, decode speed, and with a
drafter target steps, tokens per step and acceptance. --json prints one JSON object per answer
instead. Every argument is checked before the model loads; an error is one line naming the flag.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import jinja2
import torch

from .cli_flags import FLAGS, add_model_arguments
from .io.paths import default_eagle_head, default_target
from .llm import LLM
from .options import EngineOptions
from .runtime.kv_cache import KVPoolExhausted
from .sampling import SamplingParams
from .terminal import answer_all, chat_loop
from .trace import write_html, write_jsonl

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_model_arguments(common.add_argument_group("model and drafter"))
    talk = argparse.ArgumentParser(add_help=False)  # generate and chat (a server's requests carry their own)
    s = talk.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("-n", "--max-tokens", type=int, dest="max_tokens", help="new tokens at most (256, or half of a smaller --ctx-size)")
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--repeat-penalty", "--repetition-penalty", type=float, default=1.0, dest="repetition_penalty")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    o = talk.add_argument_group("prompt and output")
    o.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    o.add_argument("--system", help="a system message (chat template only)")
    o.add_argument("--no-color", action="store_true", help="no colours (also when NO_COLOR is set or stdout is no TTY)")
    o.add_argument("--show-rejected", action="store_true", help="show rejected drafts, dimmed and struck through")
    o.add_argument("--trace", type=Path, help="write every step to FILE.html (a standalone page) or FILE.jsonl")
    parser = argparse.ArgumentParser(prog="minispec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"minispec {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[common, talk], help="answer prompts (several in one batched call)")
    gen.add_argument("prompts", nargs="*", help="prompts (or --prompts FILE)")
    gen.add_argument("--prompts", dest="prompts_file", type=Path, help="a file with one prompt per line")
    gen.add_argument("--json", action="store_true", help="one JSON object per answer on stdout (no colours)")
    chat = sub.add_parser("chat", parents=[common, talk], help="an interactive multi-turn chat (/help lists the commands)")
    chat.set_defaults(json=False)
    serve = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible server (pip install 'minispec[serve]')")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("MINISPEC_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes (or $MINISPEC_API_KEY)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: the target's folder name)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 (1 MiB)")
    serve.add_argument("--max-concurrency", type=int, default=256, help="sequences in flight (each request counts prompts x n); past it 429 (256)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="requests in one continuous batch (64)")
    serve.set_defaults(json=False, no_color=True, trace=None)
    return parser


def package_version() -> str:
    try:
        return version("minispec")
    except PackageNotFoundError:
        return "(not installed)"


class CliError(Exception):
    """A problem with what the user asked for: one line on stderr, exit status 1."""


def flagged(e: Exception) -> CliError:
    """The error with the flag behind the API field it names in front."""
    message = " ".join(str(e).split())
    fields = sorted(FLAGS, key=len, reverse=True)
    field = next((f for f in fields if message.startswith(f)), None) or next(  # the field the message is about first
        (f for f in fields if f"{f}=" in message or f" {f} " in f" {message}"), None)
    return CliError(f"{FLAGS[field]}: {message}" if field else message)


def check_args(args) -> tuple[Path, str, SamplingParams, dict]:
    """Everything that can be checked before the model loads: (target, draft, params, LLM options)."""
    if args.trace is not None:
        if args.trace.suffix not in (".html", ".jsonl"):
            raise CliError(f"--trace {args.trace}: name a .html or .jsonl file")
        folder = args.trace.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise CliError(f"--trace {args.trace}: {folder} is not a writable folder")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    target = Path(args.target) if args.target else None
    if target is not None and not target.exists():
        raise CliError(f"--target {target}: no such file or directory")
    # The shipped head fits the default target only: another target drafts by n-gram unless told.
    draft = args.draft or (str(default_eagle_head()) if target is None else "ngram")
    target = target or default_target()
    if draft not in ("ngram", "none") and not Path(draft).exists():
        raise CliError(f"--draft {draft}: no such file or directory (or use 'ngram' / 'none')")
    if args.lookup_min is not None and draft in ("ngram", "none"):
        raise CliError(f"--lookup-min puts prompt lookup in front of a draft model or EAGLE head; --draft is {draft}")
    if getattr(args, "system", None) and args.no_chat_template:
        raise CliError("--system needs the chat template (--no-chat-template is set); put the instruction in the prompt instead")
    if args.command != "serve":  # (a server's requests say their own max_tokens)
        check_context(target, args)
    try:
        params = None if args.command == "serve" else SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
            min_tokens=args.min_tokens, seed=args.seed, stop=args.stop, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
        options = dict(draft_model=None if draft == "none" else draft, num_speculative_tokens=None if draft == "none" else args.k,
                       dtype=args.dtype, quantization=args.quantization,
                       draft_quantization=args.draft_quantization, row_invariant=args.row_invariant,
                       draft_vocab_size=args.draft_vocab_size, prompt_lookup_min=args.lookup_min,
                       draft_confidence_threshold=args.draft_confidence, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                       max_model_len=args.ctx_size, draft_tree_budget=args.tree_budget, draft_tree_top_k=args.tree_top_k)
        on = {name: args.command in commands if getattr(args, name) is None else getattr(args, name)  # (unset: on for these)
              for name, commands in (("enable_prefix_caching", ("serve", "chat")), ("speculation_by_load", ("serve",)),
                                     ("enable_chunked_prefill", ("serve",)))}
        options.update(on, max_num_batched_tokens=args.max_num_batched_tokens or (512 if on["enable_chunked_prefill"] else 8192),
                       pathwise_sampling=args.pathwise_sampling or ("seeded" if args.command == "serve" else "off"))
        EngineOptions(model=str(target), **options)  # validates every option without loading anything
    except ValueError as e:
        raise flagged(e) from None
    return target, draft, params, options


def check_context(target: Path, args) -> None:
    """--max-tokens against the context (--ctx-size, an HF directory's config.json or a GGUF's
    metadata); unset, it becomes 256, or half a smaller context."""
    context = None
    config = target / "config.json"
    if config.is_file():
        from .io.tokenizer import read_json_object

        context = read_json_object(config).get("max_position_embeddings")
    elif target.suffix == ".gguf":  # (its metadata only: no tensor is read)
        from .io.gguf import gguf_context_length

        context = gguf_context_length(target)
    context = context if isinstance(context, int) else None
    ctx_size = args.ctx_size if args.ctx_size is not None and args.ctx_size > 0 else None  # (a bad one: EngineOptions says)
    limit = min(c for c in (context, ctx_size) if c is not None) if (context or ctx_size) else None
    if args.max_tokens is None:
        args.max_tokens = 256 if limit is None or limit > 512 else max(limit // 2, 1)
    elif limit is not None and args.max_tokens >= limit:
        which = "--ctx-size" if limit == ctx_size else "the model's context length"
        raise CliError(f"--max-tokens {args.max_tokens}: {which} is {limit} (prompt and answer together)")


def read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise CliError(f"--prompts {args.prompts_file}: no such file")
        try:
            text = args.prompts_file.read_text(encoding="utf-8-sig")  # (a byte-order mark is not part of the first prompt)
        except UnicodeDecodeError as e:
            raise CliError(f"--prompts {args.prompts_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CliError("no prompt: give one or more prompts, or --prompts FILE")
    return prompts


def load_llm(args, target: Path, draft: str, options: dict) -> LLM:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"[minispec] loading {target.name}" + (f" and {Path(draft).name}" if draft not in ("ngram", "none") else ""),
          file=sys.stderr)
    try:
        llm = LLM(model=str(target), **options)
    except ValueError as e:
        raise flagged(e) from None
    print(f"[minispec] target {target.name}, draft {Path(draft).name if draft not in ('ngram', 'none') else draft}"
          + (f", k={args.k}" if draft != "none" else "")
          + (f", a tree of {args.tree_budget} nodes" if args.tree_budget else "")
          + (f", prompt lookup of >= {args.lookup_min} tokens first" if args.lookup_min else ""), file=sys.stderr)
    return llm


def renderer(llm: LLM, args):
    """(messages, raw text) -> the prompt: the chat template's token ids, unless asked for raw text or
    absent (then --system, which only a template can place, is refused by name; check_args
    already refused it beside --no-chat-template, before the model loaded)."""
    if getattr(args, "system", None) and not llm.tokenizer.chat_template:
        raise CliError("--system needs the chat template (this model has no chat template); put the instruction "
                       "in the prompt instead")

    def render(messages: list[dict], raw: str) -> str | dict:
        if args.no_chat_template or not llm.tokenizer.chat_template:
            return raw
        return llm.tokenizer.chat_prompt(messages)

    return render


def run(args, color: bool) -> int:
    target, draft, params, options = check_args(args)
    if args.command == "serve":
        return serve(args, target, draft, options)
    prompts = read_prompts(args) if args.command == "generate" else []
    llm = load_llm(args, target, draft, options)
    render = renderer(llm, args)
    if args.command == "generate":
        system = [{"role": "system", "content": args.system}] if args.system else []
        texts = [render(system + [{"role": "user", "content": p}], p) for p in prompts]
        answers, whole = answer_all(llm, texts, prompts, params, args, color)
        traces = [a.trace for a in answers]
    else:
        traces, whole = chat_loop(llm, args, params, color, render), True
    if args.trace is not None and args.trace.suffix == ".html":
        write_html(args.trace, traces, f"minispec {args.command}: what the draft proposed and the target kept")
    elif args.trace is not None:
        write_jsonl(args.trace, traces)
    if args.trace is not None:
        print(f"[minispec] trace written to {args.trace}", file=sys.stderr)
    return 0 if whole else 130


def serve(args, target: Path, draft: str, options: dict) -> int:
    """Load, then serve until SIGINT / SIGTERM."""
    try:
        from .server.app import serve as serve_http
    except ImportError as e:
        raise CliError(f"minispec serve needs the serve extra: pip install 'minispec[serve]' ({e.name} is missing)") from None
    for flag, value, low in (("--port", args.port, 0), ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--max-concurrency", args.max_concurrency, 1), ("--max-num-seqs", args.max_num_seqs, 1)):
        if value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")
    from .server.engine_loop import in_passing_thread

    llm = in_passing_thread(lambda: load_llm(args, target, draft, {**options, "max_num_seqs": args.max_num_seqs}))
    # What is alive now lives as long as the server: frozen out of the collector's sight, it is not
    # walked by the full collections a burst of requests sets off (the GIL held, the engine waiting).
    gc.collect()
    gc.freeze()
    serve_http(llm, args.host, args.port, args.served_model_name or target.name, args.api_key, args.max_body_bytes,
               args.max_concurrency)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    color = not args.no_color and not args.json and "NO_COLOR" not in os.environ and sys.stdout.isatty()
    try:
        return run(args, color)
    except (CliError, ValueError, TypeError, OSError, ImportError, KVPoolExhausted, jinja2.TemplateError) as e:
        print(f"minispec: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[minispec] interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `minispec` command (also `python -m minispec`): watch speculative decoding happen.

    minispec generate "Write a Python function that reverses a string."
    minispec generate --prompts prompts.txt --draft ngram -k 6 --trace run.html
    minispec chat --temperature 0.7 --top-p 0.95

On a terminal each emitted token is coloured by where it came from: green, a drafted token the
target accepted; plain, the target's own token (the replacement of the first rejected draft, or
the bonus token after all drafts were accepted). `--show-rejected` also shows the rejected drafts,
dimmed and struck through, where they were rejected. Colours are off when stdout is not a
terminal, with --no-color, or when NO_COLOR is set. After each answer one line: tokens, target
steps, tokens per step, acceptance rate, tokens/s. Everything comes from the public
`LLM.stream` events (`drafted`, `num_accepted`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jinja2

from .io.paths import default_eagle_head, default_target
from .llm import LLM
from .outputs import StreamEvent
from .runtime.kv_cache import KVPoolExhausted
from .sampling import SamplingParams
from .trace import RequestTrace, write_html, write_jsonl
GREEN, DIM_STRUCK, RESET = "\x1b[32m", "\x1b[2;9m", "\x1b[0m"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", help="target: HF directory or .gguf (default: SmolLM2-135M-Instruct, shipped)")
    common.add_argument("--draft", help="a draft HF directory or .gguf, an EAGLE-3 directory, 'ngram', or 'none' "
                                        "(default: the shipped EAGLE-3 head with the default target, else ngram)")
    common.add_argument("-k", "--num-speculative-tokens", type=int, default=4, dest="k", help="tokens drafted per step (default 4)")
    common.add_argument("--lookup-min", type=int, help="with a draft model or EAGLE head: draft by prompt lookup where "
                                                      "the last >= N tokens occurred before, by the model elsewhere")
    common.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    common.add_argument("--top-p", type=float, default=1.0)
    common.add_argument("--top-k", type=int, default=0)
    common.add_argument("--max-tokens", type=int, default=256)
    common.add_argument("--seed", type=int)
    common.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    common.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    common.add_argument("--system", help="a system message (chat template only)")
    common.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    common.add_argument("--no-color", action="store_true", help="no colours (also when NO_COLOR is set or stdout is no TTY)")
    common.add_argument("--show-rejected", action="store_true", help="show rejected drafts, dimmed and struck through")
    common.add_argument("--trace", type=Path, help="write every step to FILE.html (a standalone page) or FILE.jsonl")
    parser = argparse.ArgumentParser(prog="minispec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[common], help="answer prompts, streaming")
    gen.add_argument("prompts", nargs="*", help="prompts (or --prompts FILE)")
    gen.add_argument("--prompts", dest="prompts_file", type=Path, help="a file with one prompt per line")
    sub.add_parser("chat", parents=[common], help="an interactive multi-turn chat (/exit or Ctrl-D leaves)")
    return parser


class CliError(Exception):
    """A problem with what the user asked for: one line on stderr, exit status 1."""


def load_llm(args) -> LLM:
    if args.trace is not None and args.trace.suffix not in (".html", ".jsonl"):
        raise CliError(f"--trace {args.trace}: name a .html or .jsonl file")
    target = Path(args.target) if args.target else default_target()
    if not target.exists():
        raise CliError(f"--target {target}: no such file or directory")
    # The shipped head fits the default target only: another target drafts by n-gram unless told.
    draft = args.draft or (str(default_eagle_head()) if not args.target else "ngram")
    if draft not in ("ngram", "none") and not Path(draft).exists():
        raise CliError(f"--draft {draft}: no such file or directory (or use 'ngram' / 'none')")
    if args.lookup_min is not None and draft in ("ngram", "none"):
        raise CliError(f"--lookup-min puts prompt lookup in front of a draft model or EAGLE head; --draft is {draft}")
    llm = LLM(model=str(target), draft_model=None if draft == "none" else draft,
              num_speculative_tokens=args.k if draft != "none" else None, dtype=args.dtype,
              prompt_lookup_min=args.lookup_min)
    print(f"[minispec] target {target.name}, draft {Path(draft).name if draft not in ('ngram', 'none') else draft}"
          + (f", k={args.k}" if draft != "none" else "")
          + (f", prompt lookup of >= {args.lookup_min} tokens first" if args.lookup_min else ""), file=sys.stderr)
    return llm


def sampling_params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
                          seed=args.seed, stop=args.stop)


class Painter:
    """Prints one request's stream, each character coloured by the token it came from."""

    def __init__(self, llm: LLM, out, color: bool, show_rejected: bool):
        self.llm, self.out, self.color, self.show_rejected = llm, out, color, show_rejected
        self.ids: list[int] = []
        self.accepted_chars: list[bool] = []  # per character of the decoded output: from an accepted draft?
        self.printed = 0

    def event(self, e: StreamEvent) -> None:
        decode = self.llm.tokenizer.decode
        start = len(decode(self.ids))
        cut = min(e.num_accepted, len(e.new_token_ids))
        middle = len(decode(self.ids + e.new_token_ids[:cut]))
        self.ids += e.new_token_ids
        end = len(decode(self.ids))
        self.accepted_chars[start:] = [True] * (middle - start) + [False] * (end - middle)
        pieces = [(i < len(self.accepted_chars) and self.accepted_chars[i], ch)
                  for i, ch in enumerate(e.new_text, start=self.printed)]
        rejected, at = "", min(max(middle - self.printed, 0), len(pieces))  # where this step's accepted text ends
        self.printed += len(e.new_text)
        if self.show_rejected and e.num_accepted < len(e.drafted):
            rejected = decode(e.drafted[e.num_accepted:]).replace("\n", "\u21b5")  # newlines shown as a return arrow
            rejected = self.paint(rejected, DIM_STRUCK) if self.color else f"[-{rejected}-]"
        text = ""
        for j, (accepted, ch) in enumerate(pieces):
            text += rejected if j == at else ""
            text += self.paint(ch, GREEN) if accepted else ch
        text += rejected if at == len(pieces) else ""
        self.out.write(text)
        self.out.flush()

    def paint(self, text: str, code: str) -> str:
        return f"{code}{text}{RESET}" if self.color and text else text


def summary_line(llm: LLM) -> str:
    m = llm.last_metrics
    return (f"[{m.num_generated} tokens, {m.num_steps} target steps, {m.mean_accepted_per_step:.2f} tokens/step, "
            f"acceptance {100 * m.acceptance_rate:.1f}%, {m.tokens_per_s:.1f} tok/s]")


def answer(llm: LLM, prompt: str, args, out, color: bool) -> tuple[RequestTrace, bool]:
    """Stream one answer; returns its trace and whether it ran to the end (False after Ctrl-C)."""
    trace, painter = RequestTrace(prompt), Painter(llm, out, color, args.show_rejected)
    stream = llm.stream([prompt], sampling_params(args))
    try:
        for event in stream:
            painter.event(event)
            trace.add(event, llm.tokenizer)
    except KeyboardInterrupt:
        stream.close()  # its request and pages leave the engine
        out.write("\n[stopped]\n")
        out.flush()
        return trace, False
    if trace.error:
        out.write(f"\n[error: {trace.error}]")
    out.write("\n")
    out.flush()
    print(summary_line(llm), file=sys.stderr)
    return trace, True


def render(llm: LLM, messages: list[dict], raw: str, args) -> str:
    if args.no_chat_template or not llm.tokenizer.chat_template:
        return raw
    return llm.tokenizer.apply_chat_template(messages)


def generate(llm: LLM, args, color: bool) -> list[RequestTrace]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise CliError(f"--prompts {args.prompts_file}: no such file")
        try:
            text = args.prompts_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CliError(f"--prompts {args.prompts_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CliError("no prompt: give one or more prompts, or --prompts FILE")
    sampling_params(args)  # bad values fail here, before anything runs
    traces = []
    for prompt in prompts:
        system = [{"role": "system", "content": args.system}] if args.system else []
        text = render(llm, system + [{"role": "user", "content": prompt}], prompt, args)
        trace, finished = answer(llm, text, args, sys.stdout, color)
        traces.append(trace)
        if not finished:
            break
    return traces


def chat(llm: LLM, args, color: bool) -> list[RequestTrace]:
    sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    traces = []
    print("[minispec] chat: /exit or Ctrl-D leaves, Ctrl-C stops the current answer", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return traces
        except KeyboardInterrupt:
            print()
            continue
        if line.strip() in ("/exit", "/quit"):
            return traces
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        transcript = "\n".join(m["content"] for m in messages)
        trace, _ = answer(llm, render(llm, messages, transcript, args), args, sys.stdout, color)
        traces.append(trace)
        messages.append({"role": "assistant", "content": trace.text})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    color = not args.no_color and "NO_COLOR" not in os.environ and sys.stdout.isatty()
    try:
        llm = load_llm(args)
        traces = generate(llm, args, color) if args.command == "generate" else chat(llm, args, color)
        if args.trace is not None and args.trace.suffix == ".html":
            write_html(args.trace, traces, f"minispec {args.command}: what the draft proposed and the target kept")
        elif args.trace is not None:
            write_jsonl(args.trace, traces)
        if args.trace is not None:
            print(f"[minispec] trace written to {args.trace}", file=sys.stderr)
    except (CliError, ValueError, TypeError, OSError, KVPoolExhausted, jinja2.TemplateError) as e:
        print(f"minispec: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[minispec] interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

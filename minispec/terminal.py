"""What the `minispec` command shows on a terminal: answers coloured by where each token came from,
a summary line per answer, several prompts answered in one batched call, and the chat loop.

Green: a drafted token the target accepted; plain: the target's own token (the replacement of the
first rejected draft, or the bonus token after all drafts were accepted). With --show-rejected the
rejected drafts are shown too, dimmed and struck through, where they were rejected. Everything
comes from the public `LLM.stream` events (`drafted`, `num_accepted`).
"""

from __future__ import annotations

import json
import sys

from .llm import LLM
from .outputs import StreamEvent
from .runtime.kv_cache import KVPoolExhausted
from .runtime.metrics import RequestMetrics
from .trace import RequestTrace

GREEN, DIM_STRUCK, DIM, RESET = "\x1b[32m", "\x1b[2;9m", "\x1b[2m", "\x1b[0m"
CHAT_HELP = "/help this help   /reset forget the conversation   /exit (or Ctrl-D) leave   Ctrl-C stops the current answer"


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


class Answer:
    """One request of a batched call: its events, painted when its turn to print comes."""

    def __init__(self, prompt: str, painter: Painter | None):
        self.trace, self.painter = RequestTrace(prompt), painter
        self.pending: list[StreamEvent] = []
        self.finished: StreamEvent | None = None
        self.num_tokens = 0


def summary_line(metrics: RequestMetrics, num_tokens: int, finish_reason: str | None, drafting: bool,
                 max_tokens: int) -> str:
    """[tokens, why it stopped, time to first token, decode speed, and with a drafter: target
    steps, tokens per step and acceptance]."""
    parts = [f"{num_tokens} tokens"]
    if finish_reason == "length":
        parts.append(f"stopped at the length limit ({max_tokens} tokens: --max-tokens)")
    elif finish_reason not in (None, "stop"):
        parts.append(f"finish reason {finish_reason}")
    ttft, tpot = metrics.ttft_s(), metrics.tpot_s(num_tokens)
    if ttft is not None:
        parts.append(f"first token {ttft * 1e3:.0f} ms")
    if tpot:
        parts.append(f"decode {1 / tpot:.1f} tok/s")
    if drafting and metrics.num_steps:
        parts.append(f"{metrics.num_steps} target steps, {num_tokens / metrics.num_steps:.2f} tokens/step, "
                     f"acceptance {100 * metrics.acceptance_rate:.1f}%")
    return "[" + ", ".join(parts) + "]"


def answer_all(llm: LLM, prompts: list[str | dict], raw_prompts: list[str], params, args, color: bool) -> tuple[list[Answer], bool]:
    """Answer every prompt in ONE streamed call (continuous batching), printing the answers in
    order: the first unfinished one live, the others when their turn comes. Returns the answers
    and whether the call ran to its end (False after Ctrl-C: the rest are left, said on stderr)."""
    out = sys.stdout
    answers = [Answer(raw, None if args.json else Painter(llm, out, color, args.show_rejected)) for raw in raw_prompts]
    stream, current, done = llm.stream(prompts, params), 0, 0
    # (a progress line on a terminal only when the answers are not painted on the same terminal)
    progress = len(prompts) > 1 and sys.stderr.isatty() and (args.json or not out.isatty())
    try:
        for event in stream:
            a = answers[event.index]
            a.trace.add(event, llm.tokenizer)
            a.pending.append(event)
            a.num_tokens += len(event.new_token_ids)
            if event.finished:
                a.finished, done = event, done + 1
            while current < len(answers) and flush(answers[current], llm, args, out, color):
                current += 1
            if progress:
                print(f"\r[minispec] {done}/{len(prompts)} answered", end="", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        stream.close()  # its requests and pages leave the engine
        cut = int(current < len(answers) and answers[current].num_tokens > 0)  # the answer being printed
        if cut and answers[current].painter is not None:
            out.write("\n[stopped]\n")
        out.flush()
        print(f"\n[minispec] interrupted: {current} of {len(prompts)} prompts answered"
              + (", 1 cut short" if cut else "") + f", {len(prompts) - current - cut} skipped", file=sys.stderr)
        return answers[: current + cut], False
    if progress:
        print(file=sys.stderr)
    return answers, True


def flush(a: Answer, llm: LLM, args, out, color: bool) -> bool:
    """Print what `a` has so far; True once it is finished and printed whole."""
    if a.painter is not None:
        for event in a.pending:
            a.painter.event(event)
    a.pending = []
    if a.finished is None:
        return False
    e = a.finished
    drafting = llm.engine.k > 0
    if args.json:
        out.write(json.dumps({"prompt": a.trace.prompt, "text": a.trace.text, "num_tokens": a.num_tokens,
                              "finish_reason": e.finish_reason, "stop_reason": e.stop_reason, "error": e.error,
                              "acceptance_by_position": a.trace.acceptance_by_position()}) + "\n")
    else:
        if e.finish_reason == "length" and color:
            out.write(a.painter.paint(" \u2026", DIM))  # a visible mark where the length limit cut it
        out.write(f"\n[error: {e.error}]\n" if e.error else "\n")
    out.flush()
    print(summary_line(e.metrics or RequestMetrics(), a.num_tokens, e.finish_reason, drafting, args.max_tokens),
          file=sys.stderr)
    return True


def chat_loop(llm: LLM, args, params, color: bool, render) -> list[RequestTrace]:
    """A multi-turn chat with line editing and history (readline), /reset, /help and /exit; an
    answer stopped by Ctrl-C is dropped with its question, so the history holds only whole turns."""
    try:
        import readline  # noqa: F401  (input() gets line editing and history)
    except ImportError:
        pass
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages, traces = list(system), []
    print(f"[minispec] chat: {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return traces
        except KeyboardInterrupt:
            print()
            continue
        command = line.strip()
        if command in ("/exit", "/quit"):
            return traces
        if command == "/help":
            print(CHAT_HELP)
            continue
        if command == "/reset":
            messages = list(system)
            print("[minispec] conversation forgotten", file=sys.stderr)
            continue
        if not command:
            continue
        turn = messages + [{"role": "user", "content": line}]
        transcript = "\n".join(m["content"] for m in turn)  # the prompt without a chat template
        try:
            answers, whole = answer_all(llm, [render(turn, transcript)], [line], params, args, color)
        except (ValueError, KVPoolExhausted) as e:  # e.g. the conversation outgrew the context
            print(f"[minispec] {' '.join(str(e).split())} (/reset starts over)", file=sys.stderr)
            continue
        traces += [a.trace for a in answers]
        if whole:
            messages = turn + [{"role": "assistant", "content": answers[0].trace.text}]
        else:
            print("[minispec] the stopped answer and its question are not kept", file=sys.stderr)

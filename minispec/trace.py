"""What speculation did, step by step: records built from `StreamEvent`s, written as JSON lines or
as one standalone HTML page (inline CSS, no scripts, no network), for the `minispec` command.

Per request: its prompt, and for every target step the drafted tokens, how many the target
accepted, and the tokens the step emitted (the accepted drafts, then the target's own token: the
replacement of the first rejected draft, or the bonus token when all drafts were accepted; with no
drafts it is a plain decoding step); at the end the text, finish reason and per-position acceptance.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .io.tokenizer import Tokenizer
from .outputs import StreamEvent


@dataclass
class Step:
    drafted: list[int]  # as shown: a tree's taken branch and its first rejected child
    num_accepted: int
    emitted: list[int]
    drafted_text: list[str]
    emitted_text: list[str]
    num_drafted: int = 0  # positions drafted, as counted (a tree: its depth)

    @property
    def kind(self) -> str:
        """What the target's own token of this step was (if the step emitted one)."""
        if len(self.emitted) <= self.num_accepted:
            return "cut"  # EOS or a stop string ended the request inside the accepted run
        if not self.drafted:
            return "plain"
        return "bonus" if self.num_accepted == len(self.drafted) else "replacement"


@dataclass
class RequestTrace:
    prompt: str
    steps: list[Step] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def add(self, event: StreamEvent, tokenizer: Tokenizer) -> None:
        def pieces(ids: list[int]) -> list[str]:
            return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]

        if event.new_token_ids or event.drafted:
            self.steps.append(Step(list(event.drafted), event.num_accepted, list(event.new_token_ids),
                                   pieces(event.drafted), pieces(event.new_token_ids), event.num_drafted))
        self.text += event.new_text
        if event.finished:
            self.finish_reason, self.error = event.finish_reason, event.error

    def acceptance_by_position(self) -> list[tuple[int, int]]:
        """(accepted, drafted) for draft positions 1, 2, ..."""
        counts: list[list[int]] = []
        for s in self.steps:
            for i in range(s.num_drafted):
                if i == len(counts):
                    counts.append([0, 0])
                counts[i][1] += 1
                counts[i][0] += i < s.num_accepted
        return [(a, d) for a, d in counts]


def write_jsonl(path: Path, traces: list[RequestTrace]) -> None:
    """One line per step ({"request", "step", "drafted", ..., "kind"}), then one line per request
    with "final": true, its text, finish reason and per-position acceptance."""
    with path.open("w") as f:
        for r, t in enumerate(traces):
            for j, s in enumerate(t.steps):
                f.write(json.dumps({"request": r, "step": j, **asdict(s), "kind": s.kind}) + "\n")
            f.write(json.dumps({"request": r, "final": True, "prompt": t.prompt, "text": t.text,
                                "finish_reason": t.finish_reason, "error": t.error,
                                "acceptance_by_position": t.acceptance_by_position()}) + "\n")


CSS = """
body { font: 15px/1.5 system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h2 { border-bottom: 1px solid #ccc; }
.text { white-space: pre-wrap; font-family: ui-monospace, monospace; background: #fafafa; padding: .6em; border: 1px solid #ddd; }
.acc { background: #c8f0c8; } .own { background: #cfe0ff; } .rej { background: #f6caca; text-decoration: line-through; color: #844; }
.tok { font-family: ui-monospace, monospace; white-space: pre; padding: 0 1px; margin-right: 2px; border-radius: 3px; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
.bar { display: inline-block; height: .8em; background: #6a6; }
.legend span { margin-right: 1em; }
"""


def write_html(path: Path, traces: list[RequestTrace], title: str) -> None:
    """A standalone page: per request, the final text coloured by origin, each step's drafts
    (accepted / rejected) and the target's own token, and acceptance by draft position."""

    def tok(text: str, cls: str, arrows: bool = False) -> str:
        """A token as a coloured span (arrows: newlines drawn as a return arrow, for the step table)."""
        return f'<span class="tok {cls}">{html.escape(text.replace(chr(10), chr(0x21B5)) if arrows else text)}</span>'

    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
           '<p class="legend">' + tok("accepted draft", "acc") + tok("target's own token (replacement or bonus)", "own")
           + tok("rejected draft", "rej") + "</p>"]
    for r, t in enumerate(traces):
        drafted = sum(s.num_drafted for s in t.steps)
        accepted = sum(s.num_accepted for s in t.steps)  # the sampler's decisions, as every other count
        emitted = sum(len(s.emitted) for s in t.steps)
        out.append(f"<h2>Request {r}</h2><p><b>Prompt</b></p><div class='text'>{html.escape(t.prompt)}</div>")
        colored = "".join(tok(x, "acc" if i < s.num_accepted else "own") for s in t.steps for i, x in enumerate(s.emitted_text))
        out.append(f"<p><b>Output</b> ({emitted} tokens in {len(t.steps)} target steps, "
                   f"{emitted / max(len(t.steps), 1):.2f} per step; {accepted}/{drafted} drafts accepted; "
                   f"finish: {html.escape(str(t.finish_reason))}"
                   + (f", error: {html.escape(t.error)}" if t.error else "") + f")</p><div class='text'>{colored}</div>")
        out.append(f"<p><b>Text</b> (as returned, cut at a stop string)</p><div class='text'>{html.escape(t.text)}</div>")
        rows = "".join(f"<tr><td>{i + 1}</td><td>{a}/{d}</td><td><span class='bar' style='width:{100 * a / d:.0f}px'></span> "
                       f"{100 * a / d:.0f}%</td></tr>" for i, (a, d) in enumerate(t.acceptance_by_position()) if d)
        if rows:
            out.append(f"<p><b>Acceptance by draft position</b></p><table><tr><th>position</th><th>accepted</th>"
                       f"<th></th></tr>{rows}</table>")
        out.append("<p><b>Steps</b></p><table><tr><th>step</th><th>drafted</th><th>target's token</th><th>kind</th></tr>")
        for j, s in enumerate(t.steps):
            drafts = "".join(tok(x, "acc" if i < s.num_accepted else "rej", True) for i, x in enumerate(s.drafted_text))
            own = tok(s.emitted_text[s.num_accepted], "own", True) if len(s.emitted) > s.num_accepted else ""
            out.append(f"<tr><td>{j}</td><td>{drafts or '&mdash;'}</td><td>{own}</td><td>{s.kind}</td></tr>")
        out.append("</table>")
    out.append("</body></html>")
    path.write_text("\n".join(out))

"""The `minispec` command on tiny models.

Invariants:
  * `generate` prints exactly the text `LLM.generate` returns, then a summary line on stderr;
  * colours only on a terminal (a pty here), never with --no-color / NO_COLOR or when piped;
  * bad input: one line on stderr, exit status 1, no traceback;
  * the JSONL trace holds every step (drafts, accepted count, emitted tokens) and adds up to the
    output; the HTML trace is a standalone page a real browser renders;
  * `chat` keeps the history, and Ctrl-C stops an answer without ending the chat or leaking pages.
"""

from __future__ import annotations

import html.parser
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minispec import LLM, SamplingParams, cli

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the quick brown fox"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def base(tiny_llama, draft: str = "ngram") -> list[str]:
    return ["--target", str(tiny_llama), "--draft", draft, "--max-tokens", "10", "--seed", "0"]


@pytest.mark.parametrize("draft", ["ngram", "model", "none", "model+lookup"])
def test_generate_prints_what_llm_generate_returns(tiny_llama, tiny_llama_draft, capsys, draft):
    draft_arg = str(tiny_llama_draft) if draft.startswith("model") else draft
    lookup = 2 if draft.endswith("+lookup") else None
    status, out, err = run_cli(capsys, "generate", *base(tiny_llama, draft_arg), "--temperature", "0.8", PROMPT,
                               *(["--lookup-min", str(lookup)] if lookup else []))
    assert status == 0
    llm = LLM(model=str(tiny_llama), draft_model=None if draft == "none" else draft_arg,
              num_speculative_tokens=None if draft == "none" else 4, prompt_lookup_min=lookup)
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.8, max_tokens=10, seed=0))[0].text
    assert out == expected + "\n"
    assert "\x1b[" not in out  # captured stdout is no terminal: no colours
    summary = [line for line in err.splitlines() if "target steps" in line]
    assert len(summary) == 1 and "tokens/step" in summary[0] and "acceptance" in summary[0] and "tok/s" in summary[0]


def run_on_a_terminal(argv: list[str], env: dict) -> str:
    """Run `python -m minispec ...` with stdout on a pseudo-terminal; returns what it printed there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "minispec", *argv], stdout=slave, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, err = proc.communicate(timeout=300)
    os.close(master)
    assert proc.returncode == 0, err.decode()
    return b"".join(chunks).decode()


def test_colours_on_a_terminal_and_only_there(tiny_llama):
    """Drafting with the target itself accepts drafts, so green (accepted) text must appear; the
    same run with NO_COLOR, or with --no-color, prints the same text without escape codes."""
    argv = ["generate", "--target", str(tiny_llama), "--draft", str(tiny_llama), "--max-tokens", "12", "--seed", "0",
            "--show-rejected", PROMPT]
    colored = run_on_a_terminal(argv, {})
    assert cli.GREEN in colored and cli.RESET in colored
    plain = run_on_a_terminal(argv, {"NO_COLOR": "1"})
    assert "\x1b[" not in plain
    assert run_on_a_terminal(argv + ["--no-color"], {}) == plain
    stripped = colored
    for code in (cli.GREEN, cli.DIM_STRUCK, cli.RESET):
        stripped = stripped.replace(code, "")
    assert stripped == plain


@pytest.mark.parametrize("argv, message", [
    (["--target", "/no/such/model"], "no such file"),
    (["--draft", "/no/such/draft"], "no such file"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-tokens", "600"], "context length"),
    (["--trace", "out.txt"], ".html or .jsonl"),
    (["-k", "0"], "num_speculative_tokens"),
    (["--lookup-min", "2"], "--lookup-min puts prompt lookup in front of a draft model"),  # base()'s draft: ngram
    (["--lookup-min", "2", "--draft", "none"], "--lookup-min puts prompt lookup in front of a draft model"),
])
def test_bad_input_is_one_line_and_exit_status_1(tiny_llama, capsys, argv, message):
    args = base(tiny_llama)
    for i in range(0, len(argv), 2):  # later options override base()'s
        args += argv[i : i + 2]
    status, out, err = run_cli(capsys, "generate", *args, PROMPT)
    assert status == 1
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err  # [minispec] line + the error line
    assert err.strip().splitlines()[-1].startswith("minispec: error:") and message in err


def test_a_mismatched_draft_is_one_error_line(tiny_llama, checkpoint_factory, capsys):
    other = checkpoint_factory("llama", seed=1, num_hidden_layers=1, vocab_size=300)
    capsys.readouterr()  # (what building the checkpoint printed)
    status, _, err = run_cli(capsys, "generate", *base(tiny_llama, str(other)), PROMPT)
    assert status == 1 and err.strip().splitlines()[-1].startswith("minispec: error:") and "vocab_size" in err
    assert "Traceback" not in err


def test_no_prompt_is_an_error(tiny_llama, capsys):
    status, _, err = run_cli(capsys, "generate", *base(tiny_llama))
    assert status == 1 and "no prompt" in err


def test_jsonl_trace_records_every_step(tiny_llama, tmp_path, capsys):
    trace = tmp_path / "run.jsonl"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n\nhello world\n")
    status, out, _ = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama)), "--prompts", str(prompts),
                             "--trace", str(trace))
    assert status == 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    finals = [x for x in lines if x.get("final")]
    assert [f["prompt"] for f in finals] == [PROMPT, "hello world"]
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama), num_speculative_tokens=4)
    expected = llm.generate([PROMPT, "hello world"], SamplingParams(temperature=0, max_tokens=10, seed=0))
    assert out == "".join(o.text + "\n" for o in expected)
    for r, (final, o) in enumerate(zip(finals, expected)):
        steps = [x for x in lines if x.get("request") == r and not x.get("final")]
        assert [t for s in steps for t in s["emitted"]] == o.token_ids
        assert final["text"] == o.text
        for s in steps:
            n = s["num_accepted"]
            assert s["emitted"][:n] == s["drafted"][:n] and len(s["emitted"]) <= n + 1
            assert s["kind"] == ("bonus" if n == len(s["drafted"]) else "replacement") or s["kind"] == "cut"
        assert sum(s["num_accepted"] for s in steps) > 0  # drafting with the target accepts
        drafted = [d for a, d in final["acceptance_by_position"]]
        assert drafted[0] == sum(1 for s in steps if s["drafted"])


def html_trace(tiny_llama, tmp_path, capsys) -> Path:
    path = tmp_path / "run.html"
    status, _, _ = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama)), "--trace", str(path), PROMPT)
    assert status == 0
    return path


def test_html_trace_is_standalone_and_well_formed(tiny_llama, tmp_path, capsys):
    page = html_trace(tiny_llama, tmp_path, capsys).read_text()

    class Check(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.external = [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            self.external += [v for k, v in attrs if k in ("src", "href") and v]

    check = Check()
    check.feed(page)
    assert not check.external and "script" not in check.tags  # no network, no scripts
    assert check.tags.count("h2") == 1 and "Acceptance by draft position" in page and 'class="tok acc"' in page


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_html_trace_renders_in_a_headless_browser(tiny_llama, tmp_path, capsys):
    page = html_trace(tiny_llama, tmp_path, capsys)
    shot = tmp_path / "trace.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1000,1200", f"--screenshot={shot}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)  # [H, W, C] in [0, 1]
    assert pixels.shape[:2] == (1200, 1000)
    green = (pixels[..., 1] > 0.85) & (pixels[..., 0] < 0.85) & (pixels[..., 2] < 0.85)  # the accepted-draft background
    assert green.sum() > 500, "no accepted-draft colour on the rendered page"
    assert (pixels[..., :3].mean(-1) < 0.3).sum() > 2000, "no text on the rendered page"


def test_chat_keeps_history_and_ctrl_c_stops_only_the_answer(tiny_llama, capsys, monkeypatch):
    """Three turns, then /exit: the second is interrupted (Ctrl-C after its first event); the chat
    goes on, each prompt holds the history so far, and no page is left held at the end."""
    lines = iter(["hello world", "the quick", "brown fox", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    built, prompts_seen = [], []
    load = cli.load_llm

    def load_and_keep(args):
        llm = load(args)
        built.append(llm)
        return llm

    monkeypatch.setattr(cli, "load_llm", load_and_keep)
    answer = cli.answer

    def answer_with_interrupt(llm, prompt, args, out, color):
        prompts_seen.append(prompt)
        if len(prompts_seen) == 2:
            original = cli.Painter.event
            calls = []

            def interrupting(self, event):
                calls.append(event)
                if len(calls) == 2:
                    raise KeyboardInterrupt
                original(self, event)

            monkeypatch.setattr(cli.Painter, "event", interrupting)
            try:
                return answer(llm, prompt, args, out, color)
            finally:
                monkeypatch.setattr(cli.Painter, "event", original)
        return answer(llm, prompt, args, out, color)

    monkeypatch.setattr(cli, "answer", answer_with_interrupt)
    status, out, err = run_cli(capsys, "chat", *base(tiny_llama))
    assert status == 0 and "[stopped]" in out
    assert len(prompts_seen) == 3  # "/exit" ended it after three turns
    assert prompts_seen[1].startswith("hello world\n") and prompts_seen[1].endswith("\nthe quick")
    assert prompts_seen[2].startswith(prompts_seen[1] + "\n") and prompts_seen[2].endswith("\nbrown fox")
    llm = built[0]
    assert not llm.engine.has_unfinished()
    assert all(r.cache.allocator.num_free == r.cache.num_pages for r, _ in llm.engine.runners)

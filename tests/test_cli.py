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
import torch

from minispec import LLM, SamplingParams, cli, terminal

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
    summary = [line for line in err.splitlines() if line.startswith("[") and "tokens" in line and "first token" in line]
    assert len(summary) == 1 and "decode" in summary[0] and "tok/s" in summary[0]
    if draft == "none":  # no drafter: nothing about steps or acceptance (it used to say "acceptance 0.0%")
        assert "acceptance" not in summary[0] and "tokens/step" not in summary[0]
    else:
        assert "target steps" in summary[0] and "tokens/step" in summary[0] and "acceptance" in summary[0]


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
    assert terminal.GREEN in colored and terminal.RESET in colored
    plain = run_on_a_terminal(argv, {"NO_COLOR": "1"})
    assert "\x1b[" not in plain
    assert run_on_a_terminal(argv + ["--no-color"], {}) == plain
    # the answer stopped at --max-tokens: on a colour terminal a dim mark says so where it was cut
    assert f"{terminal.DIM} \u2026{terminal.RESET}" in colored
    stripped = colored.replace(f"{terminal.DIM} \u2026{terminal.RESET}", "")
    for code in (terminal.GREEN, terminal.DIM_STRUCK, terminal.RESET):
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


def test_chat_keeps_whole_turns_and_drops_an_interrupted_one(tiny_llama, capsys, monkeypatch):
    """Turns, /help, an answer interrupted by Ctrl-C (after its first event), /reset, /exit: the
    chat goes on; each prompt holds the whole turns so far, never the interrupted question or its
    partial answer; /reset forgets them; no page is left held at the end."""
    lines = iter(["hello world", "/help", "the quick", "brown fox", "/reset", "jumps over", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    built, prompts_seen = [], []
    load = cli.load_llm
    monkeypatch.setattr(cli, "load_llm", lambda *a: built.append(load(*a)) or built[-1])
    answer_all, original_event = terminal.answer_all, terminal.Painter.event

    def answer_with_interrupt(llm, prompts, raw, params, args, color):
        prompts_seen.append(prompts[0])
        calls = []

        def event(self, e):
            calls.append(e)
            if len(prompts_seen) == 2 and len(calls) == 2:
                raise KeyboardInterrupt
            original_event(self, e)

        monkeypatch.setattr(terminal.Painter, "event", event)
        return answer_all(llm, prompts, raw, params, args, color)

    monkeypatch.setattr(terminal, "answer_all", answer_with_interrupt)
    status, out, err = run_cli(capsys, "chat", *base(tiny_llama), "--no-chat-template")
    assert status == 0 and "[stopped]" in out and "/reset forget the conversation" in out
    assert "not kept" in err and "conversation forgotten" in err
    assert len(prompts_seen) == 4
    assert prompts_seen[1].startswith("hello world\n") and prompts_seen[1].endswith("\nthe quick")  # the first turn kept
    assert prompts_seen[2] == prompts_seen[1].removesuffix("the quick") + "brown fox"  # the interrupted turn dropped
    assert prompts_seen[3] == "jumps over"  # after /reset: nothing before it
    llm = built[0]
    assert not llm.engine.has_unfinished()
    assert all(r.cache.allocator.num_free == r.cache.num_pages for r, _ in llm.engine.runners)


# --- the first ten minutes: every option, validated first, batched, honest summaries ------------


def test_version_and_every_llm_option_reach_the_llm(tiny_llama, tiny_llama_draft, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("minispec ")
    built = []
    load = cli.load_llm
    monkeypatch.setattr(cli, "load_llm", lambda *a: built.append(load(*a)) or built[-1])
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: setattr(cli, "_threads_set", n))  # (the suite's own stays)
    status, _, _ = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama_draft)), "-k", "5", "--draft-p-min", "0.3",
                           "--lookup-min", "2", "--ngram-max", "4", "--quantization", "int8", "--ctx-size", "128",
                           "--threads", "1", "--repeat-penalty", "1.2", "--min-tokens", "2", PROMPT)
    assert status == 0
    o = built[0].options
    assert (o.num_speculative_tokens, o.draft_confidence_threshold, o.prompt_lookup_min, o.ngram_max) == (5, 0.3, 2, 4)
    assert o.quantization == "int8" and o.max_model_len == 128 and built[0].engine.max_model_len == 128
    assert cli._threads_set == 1 and torch.get_num_threads() == threads
    status, _, _ = run_cli(capsys, "generate", *base(tiny_llama, "ngram"), "--ngram-min", "2", "--ngram-max", "5", PROMPT)
    assert status == 0 and (built[1].engine.drafter.min_n, built[1].engine.drafter.max_n) == (2, 5)


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5"], "--top-p: top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "--max-tokens: max_tokens must be"),
    (["-k", "0"], "-k: num_speculative_tokens must be"),
    (["--draft-p-min", "1.5", "--draft", "DRAFT"], "--draft-p-min: "),
    (["--repeat-penalty", "0"], "--repeat-penalty: repetition_penalty"),
    (["--ctx-size", "0"], "--ctx-size: max_model_len"),
    (["--max-tokens", "600"], "--max-tokens 600: the model's context length is 512"),
    (["--prompts", "/no/such/file"], "--prompts /no/such/file: no such file"),
    (["--trace", "/no/such/folder/run.html"], "--trace /no/such/folder/run.html: /no/such/folder is not a writable folder"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--tree-budget", "64"], "--tree-budget: draft_tree_budget must be an int in [1, 63]"),
    (["--tree-top-k", "4"], "--tree-top-k: draft_tree_top_k shapes a draft tree"),
    (["--tree-budget", "8"], "--tree-budget: draft_tree_budget needs a draft model or an EAGLE-3 head"),  # draft: ngram
])
def test_arguments_are_checked_before_the_model_loads_and_name_the_flag(tiny_llama, tiny_llama_draft, capsys, monkeypatch,
                                                                        argv, message):
    """Bad flags used to be refused only after a load of several seconds, naming the API field."""
    monkeypatch.setattr(cli, "LLM", lambda *a, **k: pytest.fail("the model was loaded before the arguments were checked"))
    argv = [str(tiny_llama_draft) if a == "DRAFT" else a for a in argv]
    status, _, err = run_cli(capsys, "generate", *base(tiny_llama), *argv, PROMPT)
    assert status == 1 and err.strip().splitlines()[-1].startswith("minispec: error:") and message in err


def test_a_draft_tree_from_the_command_line(tiny_llama, tiny_llama_eagle, capsys, monkeypatch):
    stream = LLM.stream
    status, out, err = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama_eagle)), "-k", "3", "--tree-budget", "6",
                               "--tree-top-k", "3", PROMPT)
    assert status == 0 and out.strip() and "a tree of 6 nodes" in err
    seen = []  # --draft-p-min reaches the tree drafter (its confidence stop)
    monkeypatch.setattr(LLM, "stream", lambda self, p, params=None: seen.append(self.engine.drafter.confidence_threshold) or stream(self, p, params))
    status, out, _ = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama_eagle)), "-k", "3", "--tree-budget", "6",
                             "--draft-p-min", "0.2", PROMPT)
    assert status == 0 and out.strip() and seen == [0.2]


def test_prompts_are_answered_in_one_batched_call_in_order_and_as_json(tiny_llama, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\nhello world\nto be or not to be\n")
    calls = []
    stream = LLM.stream
    monkeypatch.setattr(LLM, "stream", lambda self, p, params=None: calls.append(len(p)) or stream(self, p, params))
    status, out, _ = run_cli(capsys, "generate", *base(tiny_llama), "--prompts", str(prompts), "--no-chat-template")
    assert status == 0 and calls == [3]  # one call: the prompts share the batch
    llm = LLM(model=str(tiny_llama), draft_model="ngram", num_speculative_tokens=4)
    expected = llm.generate(prompts.read_text().splitlines(), SamplingParams(temperature=0, max_tokens=10, seed=0))
    assert out == "".join(o.text + "\n" for o in expected)
    status, out, _ = run_cli(capsys, "generate", *base(tiny_llama), "--prompts", str(prompts), "--no-chat-template", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["prompt"], r["text"], r["num_tokens"], r["finish_reason"]) for r in rows] == [
        (p, o.text, len(o.token_ids), o.finish_reason) for p, o in zip(prompts.read_text().splitlines(), expected)]


def test_the_summary_says_why_it_stopped_and_counts_what_was_emitted(tiny_llama, capsys):
    """A stop string used to report '2 tokens, 2 target steps, 1.50 tokens/step'; a length cut
    looked finished."""
    status, out, err = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama)), "--no-chat-template", PROMPT)
    line = next(x for x in err.splitlines() if x.startswith("[10 tokens"))
    assert "stopped at the length limit (10 tokens: --max-tokens)" in line
    steps = int(line.split(" target steps")[0].split(", ")[-1])
    assert f"{10 / steps:.2f} tokens/step" in line
    stop = out.strip()[3:6]
    status, out, err = run_cli(capsys, "generate", *base(tiny_llama, str(tiny_llama)), "--no-chat-template",
                               "--stop", stop, PROMPT)
    line = next(x for x in err.splitlines() if x.startswith("[") and "tokens" in x and "first token" in x)
    tokens, steps = int(line[1:].split(" tokens")[0]), int(line.split(" target steps")[0].split(", ")[-1])
    assert "length limit" not in line and f"{tokens / steps:.2f} tokens/step" in line


def test_ctrl_c_exits_130_and_says_what_was_skipped(tiny_llama, tmp_path, capsys, monkeypatch):
    """Ctrl-C during generate used to exit 0 and skip the remaining prompts silently."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\nhello world\nto be or not to be\n")
    seen = []
    original = terminal.Painter.event

    def event(self, e):
        seen.append(e)
        if sum(x.finished for x in seen) == 1 and not e.finished:
            raise KeyboardInterrupt
        original(self, e)

    monkeypatch.setattr(terminal.Painter, "event", event)
    trace = tmp_path / "cut.jsonl"
    status, out, err = run_cli(capsys, "generate", *base(tiny_llama), "--prompts", str(prompts), "--no-chat-template",
                               "--trace", str(trace))
    assert status == 130 and "[stopped]" in out
    assert "interrupted: 1 of 3 prompts answered, 1 cut short, 1 skipped" in err
    finals = [json.loads(line) for line in trace.read_text().splitlines() if '"final": true' in line]
    assert len(finals) == 2 and finals[1]["finish_reason"] is None  # the answer being printed is in the trace (was left out)


def test_chat_has_line_editing_and_history(tiny_llama, tmp_path):
    """In a real terminal: a line edited with the arrow keys is sent as edited, and the up arrow
    recalls the previous line (readline), /exit leaves."""
    trace = tmp_path / "chat.jsonl"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "minispec", "chat", "--target", str(tiny_llama), "--draft", "none",
                             "--max-tokens", "3", "--no-chat-template", "--trace", str(trace)],
                            stdin=slave, stdout=slave, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    output = b""

    def read_until(marker: bytes, timeout: float = 120) -> None:
        nonlocal output
        import select
        import time

        end = time.monotonic() + timeout
        while marker not in output and time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                output += os.read(master, 65536)
        assert marker in output, output[-500:]

    read_until(b"> ")
    os.write(master, b"helo\x1b[Dl\r")  # "helo", left arrow, "l": hel|lo -> "hello"
    output = b""
    read_until(b"> ")
    os.write(master, b"\x1b[A\r")  # up arrow: the previous line again
    output = b""
    read_until(b"> ")
    os.write(master, b"/exit\r")
    proc.communicate(timeout=120)
    os.close(master)
    assert proc.returncode == 0
    finals = [json.loads(line) for line in trace.read_text().splitlines() if json.loads(line).get("final")]
    assert [f["prompt"] for f in finals] == ["hello", "hello"]


@pytest.mark.parametrize("flag", [["--temperature", "0"], ["--max-tokens", "4"], ["--system", "x"], ["--trace", "t.html"]])
def test_serve_refuses_per_request_flags(tiny_llama, capsys, monkeypatch, flag):
    """serve took the sampling and output flags and ignored them (a user passing --temperature 0
    believed the server greedy); a request's body carries them."""
    monkeypatch.setattr(cli, "serve", lambda *a: pytest.fail("the server started"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--target", str(tiny_llama), *flag])
    assert e.value.code == 2 and f"unrecognized arguments: {flag[0]}" in capsys.readouterr().err


def test_a_small_ctx_size_caps_the_default_max_tokens_and_is_named(tiny_llama, capsys, monkeypatch):
    """-c 256 failed with '--max-tokens 256: the model's context length is 256' though the user set
    neither; the default is now half a smaller context, and an explicit -n is told which limit."""
    args = ["generate", "--target", str(tiny_llama), "--draft", "none", "--seed", "0", PROMPT]
    status, out, _ = run_cli(capsys, *args[:-1], "-c", "64", "--no-chat-template", PROMPT)
    assert status == 0 and out.strip()
    status, _, err = run_cli(capsys, *args[:-1], "-c", "64", "-n", "64", PROMPT)
    assert status == 1 and "--max-tokens 64: --ctx-size is 64" in err


def test_system_without_a_template_is_refused_before_loading(tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr(cli, "LLM", lambda *a, **k: pytest.fail("the model was loaded before the arguments were checked"))
    status, _, err = run_cli(capsys, "generate", *base(tiny_llama), "--system", "x", "--no-chat-template", PROMPT)
    assert status == 1 and "--system needs the chat template (--no-chat-template is set)" in err


def test_the_html_trace_counts_accepted_drafts_as_its_table_does(tiny_llama, tmp_path):
    """Its header counted min(accepted, emitted) where EOS or a stop string cut a run (1/22 beside a
    table and a summary that said 2/22)."""
    from minispec.trace import RequestTrace, Step, write_html

    t = RequestTrace("p", [Step([5, 6, 7], 2, [5], ["a", "b", "c"], ["a"], 3), Step([8], 0, [9], ["d"], ["e"], 1)])
    write_html(tmp_path / "t.html", [t], "t")
    assert "2/4 drafts accepted" in (tmp_path / "t.html").read_text()
    assert t.acceptance_by_position() == [(1, 2), (1, 1), (0, 1)]


def test_system_with_a_model_without_a_template_is_refused(tiny_llama, capsys):
    """The tiny model has no chat template: --system is refused by name once it is loaded."""
    status, _, err = run_cli(capsys, "generate", *base(tiny_llama), "--system", "x", PROMPT)
    assert status == 1 and "--system needs the chat template (this model has no chat template)" in err

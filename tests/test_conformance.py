"""Wrong output that no exception reported, arguments that were silently ignored, and outputs shaped
like vLLM's. Each case names what it used to do.

Invariants:
  * streamed text, concatenated, is generate's text, whatever the stop strings' lengths;
  * output text reads as it does after the prompt (vLLM's detokenizer), also with SentencePiece
    decoders that strip a text's leading space;
  * a KeyboardInterrupt anywhere in a call ends every request in flight with finish_reason
    "error" (never wrong tokens), frees every page, and leaves the LLM exact for later calls;
  * SamplingParams are the caller's: changing them after a call was made changes nothing in it;
  * a bad file is named with what is wrong with it; a built EAGLE head for another target is
    refused when the LLM is made; every argument is honoured or refused by name;
  * outputs carry vLLM's fields: request_id, prompt, prompt_token_ids, outputs[i] (index, text,
    token_ids, cumulative_logprob, logprobs as Logprob objects, finish_reason, stop_reason), finished.
"""

from __future__ import annotations

import json
import shutil
from collections import deque

import pytest
import torch

import minispec.llm
from minispec import LLM, SamplingParams, cli, load_checkpoint
from minispec.io.eagle_checkpoint import load_eagle
from minispec.io.tokenizer import Tokenizer
from minispec.outputs import CompletionOutput, Logprob, RequestOutput

pytestmark = pytest.mark.usefixtures("one_thread")

from test_reliability import GREEDY, PROMPTS, generate_interrupted, idle_and_whole, sampled, spec  # noqa: E402,F401  (one definition of each)


# --- 1. streamed text ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["ZZZZZZZZZZZZZZZZZZZZ", "\n\nUser: please continue", "QQQQ"])
def test_streamed_text_is_generates_text_with_a_stop_string_longer_than_the_output(spec, stop):
    """A stop string of 4 or more characters used to send the start of the answer again and again
    ('HHelHello'): the hold-back computed a negative end while the output was shorter than it."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=[stop]) for n in (3, 10, 10)]
    expected = [o.text for o in spec.generate(PROMPTS, params)]
    texts = ["", "", ""]
    for e in spec.stream(PROMPTS, params):
        texts[e.index] += e.new_text
        assert expected[e.index].startswith(texts[e.index])  # nothing sent twice, nothing that is not there
    assert texts == expected and all(expected)


def sentencepiece_tokenizer(vocab_size: int) -> Tokenizer:
    """A Llama 2 / Mistral-style tokenizer (SentencePiece BPE as HF converts it): every token a
    word with its leading '▁', decoded to a space that the decoder strips from the text's start."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<s>": 0, "</s>": 1, **{f"▁w{i}": i for i in range(2, vocab_size)}}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok, [1], 0)


def test_output_text_reads_as_after_the_prompt_with_a_sentencepiece_tokenizer(tiny_llama):
    """Decoded alone, an output lost its first token's leading space ('▁Paris' -> 'Paris'), so
    text, streamed text and logprobs' decoded tokens differed from vLLM's (which renders output
    after the prompt) and a stop string starting with a space never matched the first token."""
    llm = LLM(model=tiny_llama, kv_cache_gib=0.01)
    tok = llm.tokenizer = llm.engine.tokenizer = sentencepiece_tokenizer(llm.engine.target.model.cfg.vocab_size)
    prompt = {"prompt_token_ids": [2, 4, 6]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params)[0].outputs[0]
    words = [f" w{t}" for t in out.token_ids]
    assert out.text == "".join(words)
    assert [entry[t].decoded_token for t, entry in zip(out.token_ids, out.logprobs)] == words
    assert "".join(e.new_text for e in llm.stream([prompt], params)) == out.text
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[words[1]]))
    text = "".join(words)
    assert (stopped[0].outputs[0].text, stopped[0].outputs[0].stop_reason) == (text[: text.find(words[1])], words[1])


def test_the_cli_prints_the_answer_once_with_a_long_stop_string(tiny_llama, capsys):
    args = ["generate", "--target", str(tiny_llama), "--draft", "ngram", "--no-chat-template", "--max-tokens", "10",
            "--stop", "ZZZZZZZZZZZZZZZZZZZZ", "hello world"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    llm = LLM(model=str(tiny_llama), draft_model="ngram")
    expected = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=10, stop=["ZZZZZZZZZZZZZZZZZZZZ"]))
    assert printed == expected[0].text + "\n"


# --- 2. interrupts ------------------------------------------------------------------------------


POINTS = [("drafter", "stage", 2), ("target", "prepare", 2), ("drafter", "run_staged", 2), ("target", "run", 2),
          ("engine", "_emit", 2), ("drafter", "rollback", 1), ("target_table", "truncate", 2)]


@pytest.mark.parametrize("where, name, call", POINTS)
def test_an_interrupt_inside_a_step_fails_every_request_in_flight_and_nothing_else(spec, where, name, call):
    """An interrupt between verification and roll-back (or mid-emission) used to leave the batch
    half-updated: another call's stream later got wrong tokens silently or 'bad feed: 0 tokens, 1
    logits'. Now every request in flight ends with "error", and later calls are exact."""
    solo = [o.token_ids for o in spec.generate(PROMPTS, [sampled(i) for i in range(3)])]
    other = spec.stream(PROMPTS[:2], [sampled(0), sampled(1)])
    first = next(other)  # the other call's requests are running
    from minispec.runtime.kv_cache import BlockTable  # (target_table: inside the target's roll-back, the class)

    owner = {"drafter": spec.engine.drafter, "target": spec.engine.target, "engine": spec.engine,
             "target_table": BlockTable}[where]
    generate_interrupted(spec, PROMPTS[2:], sampled(2), owner, name, call)
    rest = list(other)
    finals = [e for e in [first] + rest if e.finished]
    assert {e.index for e in finals} <= {0, 1}
    for e in finals:  # finished before the interrupt (exact) or ended by it ("error"), never wrong
        assert e.finish_reason in ("length", "error")
        if e.finish_reason == "error":
            assert "KeyboardInterrupt" in e.error
    tokens = [[], []]
    for e in [first] + rest:
        tokens[e.index] += e.new_token_ids
    for i in range(2):
        assert solo[i][: len(tokens[i])] == tokens[i]  # what was emitted is a prefix of the exact output
    assert idle_and_whole(spec)
    assert [o.token_ids for o in spec.generate(PROMPTS, [sampled(i) for i in range(3)])] == solo


def test_an_interrupt_between_queueing_and_owning_leaves_no_orphan(spec, monkeypatch):
    """Requests queued but never owned used to keep being stepped by later calls, holding pages."""
    real_call = minispec.llm._Call

    class Interrupted(real_call):
        def __init__(self, *args, **kwargs):
            raise KeyboardInterrupt

    expected = [o.token_ids for o in spec.generate(PROMPTS, GREEDY)]
    monkeypatch.setattr(minispec.llm, "_Call", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        spec.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(minispec.llm, "_Call", real_call)
    assert idle_and_whole(spec)  # the queued requests were aborted, their pages freed
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == expected


# --- 3. params are copied -----------------------------------------------------------------------


def test_sampling_params_changed_after_the_call_change_nothing(tiny_llama, spec):
    """The request used to share the caller's object: raising max_tokens after queueing skipped
    the context check (558 positions in a 512-token context) and changed the running request."""
    params = sampled(4, max_tokens=6)
    expected = spec.generate(PROMPTS[:1], sampled(4, max_tokens=6))[0].token_ids
    stream = spec.stream(PROMPTS[:1], params)
    params.max_tokens, params.temperature, params.seed, params.stop = 600, 0.1, 9, ["e"]
    assert [t for e in stream for t in e.new_token_ids] == expected
    assert idle_and_whole(spec)


# --- 4. files -----------------------------------------------------------------------------------


def broken_copy(tiny_llama, tmp_path, name: str, content: bytes):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, path)
    (path / name).write_bytes(content)
    return path


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", b"{not json", "tokenizer.json is not a readable tokenizer"),
    ("model.safetensors", b"", "model.safetensors is not a readable safetensors file"),
    ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1", "model.safetensors is not a readable"),
    ("config.json", b"[1, 2]", "config.json must hold a JSON object"),
    ("config.json", b"{\"vocab_size\": ", "config.json is not valid JSON"),
    ("tokenizer_config.json", b"\xff\xfe", "tokenizer_config.json is not valid JSON"),
])
def test_a_corrupt_file_is_named_with_its_problem(tiny_llama, tmp_path, capsys, name, content, message):
    """Used to raise bare JSONDecodeError / SafetensorError / AttributeError without the file, and
    a traceback from the CLI."""
    path = broken_copy(tiny_llama, tmp_path, name, content)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), kv_cache_gib=0.01)
    assert cli.main(["generate", "--target", str(path), "--draft", "none", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and err[-1].startswith("minispec: error:") and name in err[-1]  # ([minispec] loading ..., then it)
    assert "Traceback" not in "\n".join(err)


def test_a_truncated_safetensors_file_is_named(tiny_llama, tmp_path):
    data = (tiny_llama / "model.safetensors").read_bytes()
    path = broken_copy(tiny_llama, tmp_path, "model.safetensors", data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_checkpoint(path)


def test_integer_weights_are_refused_by_name(tiny_llama, tmp_path):
    """A quantized export without its scales used to load silently and generate garbage."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, path)
    state = load_file(path / "model.safetensors")
    key = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    state[key] = state[key].to(torch.int8)
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"checkpoint {path}: tensor {key.removeprefix('model.')} holds torch.int8"):
        load_checkpoint(path)


def test_a_prompts_file_that_is_not_utf8_is_named(tiny_llama, tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"hello\n\xff\xfe world\n")
    assert cli.main(["generate", "--target", str(tiny_llama), "--draft", "none", "--prompts", str(bad)]) == 1
    assert f"--prompts {bad}: not UTF-8 text" in capsys.readouterr().err


def test_a_prompts_files_byte_order_mark_and_a_system_message_without_a_template(tiny_llama, tmp_path, capsys):
    """A UTF-8 byte-order mark (Windows Notepad) used to stay in the first prompt, and --system was
    silently dropped where no chat template could place it."""
    marked = tmp_path / "prompts.txt"
    marked.write_bytes(b"\xef\xbb\xbfHello there\nSecond\n")
    assert cli.read_prompts(cli.build_parser().parse_args(["generate", "--prompts", str(marked)])) == ["Hello there", "Second"]
    capsys.readouterr()
    assert cli.main(["generate", "--target", str(tiny_llama), "--draft", "none", "--system", "be brief",
                     "--no-chat-template", "hi"]) == 1
    assert "--system needs the chat template (--no-chat-template is set)" in capsys.readouterr().err


def test_draft_vocab_size_zero_is_named(tiny_llama, tiny_llama_eagle, tmp_path):
    """Used to be reported as a d2t shape mismatch."""
    path = tmp_path / "head"
    shutil.copytree(tiny_llama_eagle, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["draft_vocab_size"] = 0
    (path / "config.json").write_text(json.dumps(cfg))
    target, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="draft_vocab_size 0"):
        load_eagle(path, target)


def test_a_built_head_for_another_target_is_refused_when_the_llm_is_made(tiny_llama, tiny_llama_eagle, checkpoint_factory):
    """Used to be accepted and to fail at the first draft step with a matmul shape error that
    ended every request."""
    target, tok = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    head = load_eagle(tiny_llama_eagle, target)
    other = load_checkpoint(checkpoint_factory(hidden_size=128, intermediate_size=96), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(model=other, draft_model=head, kv_cache_gib=0.01)
    assert LLM(model=(target, tok), draft_model=head, kv_cache_gib=0.01).generate(PROMPTS[:1], GREEDY)[0].token_ids


def test_device_meta_is_refused_before_loading(tiny_llama):
    with pytest.raises(ValueError, match="device 'meta'"):
        LLM(model=tiny_llama, device="meta")


# --- 5. arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_speculative_tokens=3), "num_speculative_tokens needs a drafter"),
    (dict(draft_model="DRAFT", ngram_max=4), "ngram_max set the n-gram drafter's window"),
    (dict(ngram_min=2), "ngram_min set the n-gram drafter's window"),
    (dict(draft_model="DRAFT", prompt_lookup_min=3, ngram_max=2), "ngram_max 2 .* below prompt_lookup_min 3"),
    (dict(max_model_len=100_000), "max_model_len 100000 is longer than the target's context"),
    (dict(speculative_config={"model": "DRAFT", "prompt_lookup_min": 4, "prompt_lookup_max": 2}), "prompt_lookup_max 2 is below"),
    (dict(speculative_config={"method": "ngram", "model": "DRAFT"}), "method 'ngram' drafts without a model"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in \\(0, 1\\]"),
    (dict(enforce_eager=True, cuda_graphs=True), "contradict"),
    (dict(seed=-1), "seed"),
])
def test_arguments_are_honoured_or_refused_by_name(tiny_llama, tiny_llama_draft, kwargs, message):
    """Each was silently ignored or changed: k without a drafter, an n-gram window nothing used,
    max_model_len clipped to the model's context, a window widened, a model ignored, a GPU share
    above 1 accepted on CPU."""
    kwargs = json.loads(json.dumps(kwargs).replace('"DRAFT"', json.dumps(str(tiny_llama_draft))))
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama, kv_cache_gib=0.01, **kwargs)


def test_multi_modal_data_in_a_prompt_dict_is_refused(spec):
    with pytest.raises(ValueError, match="multi_modal_data"):
        spec.generate([{"prompt": "hi", "multi_modal_data": {"image": None}}], GREEDY)
    assert idle_and_whole(spec)


# --- 6. preemption bookkeeping ------------------------------------------------------------------


def test_the_scheduler_keeps_nothing_per_finished_request(tiny_llama, tiny_llama_draft):
    """A per-request preemption counter used to grow by one entry per request ever preempted."""
    from minispec.runtime.kv_cache import KVCache

    models = [load_checkpoint(p, dtype=torch.float32, device="cpu") for p in (tiny_llama, tiny_llama_draft)]
    per_page = sum(KVCache.bytes_per_page(m.cfg, 4, torch.float32) for m, _ in models)
    llm = LLM(model=models[0], draft_model=models[1], num_speculative_tokens=3, page_size=4,
              kv_cache_gib=13 * per_page / 2**30)
    outs = llm.generate(PROMPTS * 3, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and llm.last_metrics.num_preemptions == scheduler.num_preemptions
    assert sum(o.metrics is not None for o in outs) == len(outs)
    containers = [v for k, v in vars(scheduler).items() if k != "runners" and isinstance(v, (list, dict, deque, set))]
    assert containers and all(len(c) == 0 for c in containers)


# --- 7. vLLM's output objects and spellings -----------------------------------------------------


def test_outputs_have_vllms_fields(spec):
    stop = spec.generate(PROMPTS[:1], GREEDY)[0].text[2:5]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])]
    outs = spec.generate([PROMPTS[0], {"prompt_token_ids": spec.tokenizer.encode(PROMPTS[0])}], params)
    for o in outs:
        assert isinstance(o, RequestOutput) and isinstance(o.request_id, str) and o.finished
        assert o.prompt_logprobs is None and len(o.outputs) == 1 and isinstance(o.outputs[0], CompletionOutput)
        assert o.outputs[0].index == 0 and o.outputs[0].finished()
    first, second = outs
    assert first.prompt == PROMPTS[0] and second.prompt is None and first.request_id != second.request_id
    c = first.outputs[0]
    assert c.finish_reason == "length" and c.stop_reason is None
    assert all(isinstance(lp, Logprob) and lp.rank >= 1 and isinstance(lp.decoded_token, str)
               for entry in c.logprobs for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)))
    s = second.outputs[0]
    assert (s.finish_reason, s.stop_reason) == ("stop", stop) and s.logprobs is None and s.cumulative_logprob is None
    events = [e for e in spec.stream([PROMPTS[0]], params[1]) if e.finished]
    assert (events[0].finish_reason, events[0].stop_reason) == ("stop", stop)


def test_vllms_eagle_example_and_options_run(tiny_llama, tiny_llama_eagle):
    """vLLM's EAGLE example used to be refused for draft_tensor_parallel_size; dtype "half" /
    "float", seed=, tokenizer= and enforce_eager= were missing."""
    llm = LLM(model=str(tiny_llama), dtype="float", enforce_eager=True, tokenizer=str(tiny_llama), seed=7,
              speculative_config={"method": "eagle3", "model": str(tiny_llama_eagle), "draft_tensor_parallel_size": 1,
                                  "num_speculative_tokens": 3}, kv_cache_gib=0.01)
    assert llm.engine.k == 3 and llm.engine.target.model.dtype == torch.float32 and llm.engine.target.static is None
    assert LLM(model=str(tiny_llama), dtype="half", kv_cache_gib=0.01).engine.target.model.dtype == torch.float16


def test_llm_seed_makes_unseeded_requests_reproducible(tiny_llama):
    """LLM(seed=s): requests without their own seed draw theirs from it, in submission order."""
    runs = []
    for seed in (7, 7, 8):
        llm = LLM(model=str(tiny_llama), seed=seed, kv_cache_gib=0.01)
        runs.append([o.token_ids for o in llm.generate(PROMPTS, sampled(None))])
    assert runs[0] == runs[1] and runs[0] != runs[2]

"""A speculative step's host <-> device traffic (runtime/transfers.py): one upload, one download.

On a GPU every transfer inside a step is a wait: the host stops until the device catches up, and
the device idles while the host prepares what comes next. So a step sends everything it knows in
advance in one upload and brings its verdict back in one download.

On a CPU there is no device to wait for, so the test counts what WOULD be a transfer on a GPU:
  * host data becoming a tensor: aten `lift_fresh` (torch.tensor, torch.from_numpy, indexing or
    assigning with a Python list all go through it);
  * a tensor read on the host: aten `_local_scalar_dense` (item, bool, int, float), and
    Tensor.tolist / Tensor.numpy, which dispatch nothing and are wrapped here;
except inside runtime/transfers.py, whose `Staging` counts its own uploads and downloads, and
inside what stands for the GPU's attention kernels on a CPU: Triton's interpreter, and the torch
backend's CPU attention plans (fast/attention_plans.py plans on the host from the metadata, a CPU
choice). Static shapes, as on a GPU. Plain decoding runs on the Triton backend (its launchers are
what a GPU runs); the drafters on the torch backend (the same step code, far faster under test).
On a GPU the same tests count real transfers, on CUDA with its CUDA graphs and the Triton kernels
everywhere (`DRAFTER_BACKEND`).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minispec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

# The drafters' tests on a CPU take the torch backend (far faster than the interpreter); on a GPU
# the default, the Triton kernels: the torch backend plans each forward on the host
# (fast/attention_plans.py), and a CUDA graph (the default there) would keep its capture's plan.
DRAFTER_BACKEND = None if torch.cuda.is_available() else "torch"

EXEMPT = ("runtime/transfers.py", "triton/runtime/interpreter.py", "triton/language", "fast/attention_plans.py")


def exempt_caller() -> bool:
    """Whether the current call comes from the staging code or from a Triton kernel's interpreter."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(part in name for part in EXEMPT):
            return True
        frame = frame.f_back
    return False


def ours(frame) -> str:
    """The innermost caller in minispec or its kernels (what a failure message should name)."""
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/minispec/" in name or "/kernels/" in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class TransferCounter(TorchDispatchMode):
    """Counts host -> device ("up") and device -> host ("down") traffic outside the staging code."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.counts = {"up": 0, "down": 0}
        self.where: list[str] = []
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)

            def wrapped(tensor, *args, _original=original, _method=method, **kwargs):
                self.count("down", _method)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, method, wrapped)

    def count(self, direction: str, what: str) -> None:
        if not exempt_caller():
            self.counts[direction] += 1
            self.where.append(f"{direction} {what} at {ours(sys._getframe(2))}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.count("up", str(func))
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.count("down", str(func))
        return func(*args, **(kwargs or {}))


def staged(llm: LLM) -> tuple[int, int]:
    runners = [runner for runner, _ in llm.engine.runners]
    return sum(r.staging.uploads for r in runners), sum(r.staging.downloads for r in runners)


def step_transfers(llm: LLM, params: list[SamplingParams], monkeypatch, steps: int = 3, prompts: list[str] | None = None
                   ) -> list[dict]:
    """Per engine step after warm-up (every request has emitted its first token): the staging's
    uploads and downloads, and the other transfers the counter saw (with where they happened)."""
    engine = llm.engine
    while engine.has_unfinished():  # (what an earlier call left running)
        engine.step()
    for i, p in enumerate(params):
        engine.add_request(llm.tokenizer.encode(prompts[i] if prompts else f"the quick brown fox {i} jumps"), p)
    while any(not s.output_ids for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.step()  # (a drafter that reads the target's features drafts from the second step on)
    out = []
    for _ in range(steps):
        before = staged(llm)
        with TransferCounter(monkeypatch) as counter:
            engine.step()
        after = staged(llm)
        out.append({"uploads": after[0] - before[0], "downloads": after[1] - before[1], **counter.counts,
                    "where": counter.where})
    return out


GREEDY = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, ignore_eos=True, seed=i) for i in range(2)]
PATHWISE = [dataclasses.replace(p, pathwise=True) for p in SAMPLED]
MIXED = [PATHWISE[0], SAMPLED[1]]  # a pathwise request beside a standard one


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft", "eagle"])
def test_a_step_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft, tiny_llama_eagle, drafter, monkeypatch):
    """Plain decoding, the n-gram drafter (whose drafts are the host's), a draft model and the
    EAGLE head (whose k forwards draw on the device, each feeding the next), greedy requests,
    sampled ones, pathwise ones (the noise is made on the device from uploaded lanes) and a
    pathwise request beside a standard one: a step after warm-up sends one upload and
    brings one download, and nothing else crosses."""
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())  # the GPU's full sort (a CPU checks on the host)
    args = {"none": {}, "ngram": dict(draft_model="ngram", num_speculative_tokens=3),
            "draft": dict(draft_model=str(tiny_llama_draft), num_speculative_tokens=3),
            "eagle": dict(draft_model=str(tiny_llama_eagle), num_speculative_tokens=3)}[drafter]
    backend = "triton" if drafter == "none" else DRAFTER_BACKEND
    llm = LLM(model=str(tiny_llama), kv_cache_gib=0.01, backend=backend, static_shapes=True, **args)
    # (Plain decoding runs the Triton kernels in the interpreter: greedy, and the mix of a pathwise
    # and a standard sampled request, cover its paths.)
    cases = (GREEDY, MIXED) if drafter == "none" else (GREEDY, SAMPLED, PATHWISE, MIXED)
    for params in cases:
        for step in step_transfers(llm, params, monkeypatch, steps=2):
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    if drafter in ("draft", "eagle"):  # (the drafter did draft, on the device)
        counts = llm.engine.drafter.runner.forward_counts
        assert counts["static"] + counts["graph"] > 0  # (on a GPU the static forwards replay graphs)


REPEATING = ["a b a b a b a b", "the quick brown fox"]  # lookup finds matches in the first, and some steps of the second


def lookup_llm(model: str, tiny_llama, tiny_llama_draft, tiny_llama_eagle) -> LLM:
    """Prompt lookup (of >= 1 token) in front of the draft model or the EAGLE head, static shapes."""
    draft = {"draft": tiny_llama_draft, "eagle": tiny_llama_eagle}[model]
    return LLM(model=str(tiny_llama), kv_cache_gib=0.01, backend=DRAFTER_BACKEND, static_shapes=True,
               draft_model=str(draft), num_speculative_tokens=3, prompt_lookup_min=1)


@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_lookup_in_front_of_a_model_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft, tiny_llama_eagle,
                                                                       model, monkeypatch):
    """Prompt lookup in front of a draft model or the EAGLE head (drafters/lookup.py): lookup
    decides on the host and its tokens ride up; the model drafts on the device for the sequences
    lookup found nothing for. Greedy then sampled: one upload and one download a step, nothing
    else, with both lookup and the model drafting."""
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())
    llm = lookup_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle)
    for params in (GREEDY, SAMPLED, PATHWISE):
        for step in step_transfers(llm, params, monkeypatch, steps=3, prompts=REPEATING):
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    assert llm.engine.drafter.lookup_drafts > 0 and llm.engine.drafter.model_drafts > 0


@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_a_catch_up_after_looked_up_steps_rides_in_the_same_upload(tiny_llama, tiny_llama_draft, tiny_llama_eagle,
                                                                    model, monkeypatch):
    """After steps that lookup drafted, the model's catch-up is longer than its largest bucket
    and comes in pieces (`feed_ahead`): in a staged step they are prepared into the step's one
    upload and run on the device before the first draft forward (the EAGLE head's with their
    target features), so that step too makes one upload and one download. Lookup is made to
    leave a sequence's first two steps (the prompt's, and the first the EAGLE head can draft in:
    warm-up) and every fifth after them to the model, and to draft the others (its last tokens
    again: what it proposes is not what is tested), so the model's step after 4 looked-up steps
    catches up on at least 5 tokens, more than the bucket of k + 1."""
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())
    llm = lookup_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle)
    hybrid, calls, pieces = llm.engine.drafter, {}, []

    def every_fifth_to_the_model(tokens, k):
        n = calls[tuple(tokens[:2])] = calls.get(tuple(tokens[:2]), -1) + 1  # (the prompts' first tokens differ)
        return tokens[-k:] if n > 0 and n % 5 != 1 else []

    feed_ahead = hybrid.model_drafter.feed_ahead

    def recorded(seqs, upload=None):
        staged = feed_ahead(seqs, upload)
        pieces.extend(staged)
        return staged

    monkeypatch.setattr(hybrid.lookup, "lookup", every_fifth_to_the_model)
    monkeypatch.setattr(hybrid.model_drafter, "feed_ahead", recorded)
    params = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=i) for i in range(2)]
    for step in step_transfers(llm, params, monkeypatch, steps=5, prompts=["one two three", "x y z"]):
        assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    assert pieces, "no catch-up came in pieces"


def test_the_counter_sees_a_transfer(tiny_llama, monkeypatch):
    """The check can fail: a step that reads one value on the host (here the penalties' host
    path, `host_step`, which reads token histories) is counted."""
    llm = LLM(model=str(tiny_llama), kv_cache_gib=0.01, backend="triton", static_shapes=True)
    monkeypatch.setattr("minispec.speculative.needs_host", lambda seq: True)
    penalised = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2)] * 2
    steps = step_transfers(llm, penalised, monkeypatch, steps=1)
    assert steps[0]["up"] + steps[0]["down"] > 0
    with TransferCounter(monkeypatch) as counter:
        torch.tensor([1, 2]).tolist()
    assert counter.counts == {"up": 1, "down": 1}


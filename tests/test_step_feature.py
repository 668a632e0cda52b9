"""The engine's step hook (runtime/step_feature.py): a feature runs before each step (it may change
k or take sequences out of the step) and after it (it sees the step's record while the sequences
still hold their pages); neither can change a greedy request's tokens."""

from minispec import LLM, SamplingParams
from minispec.runtime.step_feature import StepFeature

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Recording(StepFeature):
    """Asks for no drafts in odd steps and lets the first sequence sit out every third step;
    records what each `after` saw."""

    def __init__(self):
        self.steps = 0
        self.seen: list[tuple[int, list[int], bool]] = []  # (k, request ids, every one still holds pages)

    def before(self, engine, seqs, k):
        self.steps += 1
        if self.steps % 3 == 0 and len(seqs) > 1:
            seqs = seqs[1:]
        return seqs, 0 if self.steps % 2 else k

    def after(self, engine, record):
        holding = all(s.target_table.pages for s in record.seqs)
        self.seen.append((record.k, [s.request_id for s in record.seqs], holding))


def test_a_feature_that_changes_k_and_the_batch_changes_no_greedy_token(tiny_llama, tiny_llama_draft):
    """A step feature that varies k and drops a sequence from some steps: the greedy tokens are
    plain decoding's; its `after` sees the k and the batch its `before` chose, before any finished
    sequence gave its pages back."""
    plain = LLM(model=str(tiny_llama), kv_cache_gib=0.01).generate(PROMPTS, GREEDY)
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.01)
    feature = Recording()
    llm.engine.features.append(feature)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert {k for k, _, _ in feature.seen} == {0, 3}
    assert any(len(ids) < len(PROMPTS) for _, ids, _ in feature.seen[2::3])  # a sequence sat a step out
    assert all(holding for _, _, holding in feature.seen)


def test_the_engine_lists_its_features_in_the_order_they_run(tiny_llama, tiny_llama_draft):
    """Speculation by load chooses k before chunked prefill plans with it; the prefix cache is both
    the scheduler's admission and a step feature; the metrics stamps always run."""
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.01,
              speculation_by_load=True, enable_chunked_prefill=True, enable_prefix_caching=True,
              max_num_batched_tokens=16)
    names = [type(f).__name__ for f in llm.engine.features]
    assert names == ["SpeculationByLoad", "ChunkedPrefill", "PrefixCache", "StepMetrics"]
    assert llm.engine.scheduler.admission is llm.engine.features[2]
    plain = LLM(model=str(tiny_llama), kv_cache_gib=0.01)
    assert [type(f).__name__ for f in plain.engine.features] == ["StepMetrics"]

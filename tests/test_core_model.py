"""The core's decoder (minispec/core/model.py) is the production decoder's reference.

* The core Transformer on its torch backend (the kernels' plain torch twins) gives the production
  Transformer's logits (its torch backend batches paged attention over the sequences, see
  fast/attention_plans.py) with the same weights: for a prefill that writes the KV pool and for a
  decode step that reads it back. Prefill runs the same ops on both sides: the same bits.
(That the core imports nothing else of minispec: tests/test_core_engine.py, for every core file.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minispec.core import model as core
from minispec.core.config import ModelConfig
from minispec.model.attention import AttentionBackend
from minispec.model.llama import Transformer
from minispec.model.metadata import BatchMetadata

CORE = Path(__file__).resolve().parents[1] / "minispec" / "core"
PAGE_SIZE, NUM_PAGES = 4, 8
PROMPTS = [[5, 9, 1, 17, 3], [2, 30, 7]]
BLOCK_TABLES = [[0, 1], [2, 3]]  # sequence b's pages: room for 8 tokens each


def small_config(**overrides) -> ModelConfig:
    args = dict(architecture="llama", vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=[0])
    return ModelConfig(**{**args, **overrides})


def slots(b: int, positions: list[int]) -> list[int]:
    """Pool slots (page * page_size + offset) of sequence b's tokens at `positions`."""
    return [BLOCK_TABLES[b][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions]


def step_metadata(cls, lengths_before: list[int], new: list[int]):
    """Metadata of one forward: sequence b has lengths_before[b] cached tokens and new[b] new ones."""
    positions = [p for before, n in zip(lengths_before, new) for p in range(before, before + n)]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    seq_lens = [before + n for before, n in zip(lengths_before, new)]
    slot_mapping = [s for b, (before, n) in enumerate(zip(lengths_before, new))
                    for s in slots(b, list(range(before, before + n)))]
    return cls(
        positions=torch.tensor(positions),  # [T]
        query_start_loc=torch.tensor(starts, dtype=torch.int32),  # [B+1]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slot_mapping),  # [T]
        block_tables=torch.tensor(BLOCK_TABLES, dtype=torch.int32),  # [B, 2]
        logits_indices=torch.tensor(starts[1:]) - 1,  # [B] each sequence's last new row
        is_prefill=all(before == 0 for before in lengths_before),
    )


def kv_pool(cfg: ModelConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_pool, v_pool), each [num_pages, page_size, Hkv, D]."""
    shape = (NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_core_and_production_give_the_same_logits(sliding_window):
    """Prefill (writing the pool) and a cached decode: the core's logits are the production's."""
    cfg = small_config(sliding_window=sliding_window)
    torch.manual_seed(0)
    reference = core.Transformer(cfg, core.AttentionBackend("torch")).eval()
    production = Transformer(cfg, AttentionBackend("torch")).eval()
    production.load_state_dict(reference.state_dict())
    pools = {"core": kv_pool(cfg), "production": kv_pool(cfg)}
    lengths = [len(p) for p in PROMPTS]
    prompt_ids = torch.tensor([t for p in PROMPTS for t in p])  # [T]
    prefill = {"core": reference(prompt_ids, step_metadata(core.BatchMetadata, [0, 0], lengths), pools["core"]),
               "production": production(prompt_ids, step_metadata(BatchMetadata, [0, 0], lengths),
                                        pools["production"])}
    assert prefill["core"].shape == (len(PROMPTS), cfg.vocab_size)
    assert torch.equal(prefill["core"], prefill["production"])
    for (k_core, v_core), (k_prod, v_prod) in zip(pools["core"], pools["production"]):
        assert torch.equal(k_core, k_prod) and torch.equal(v_core, v_prod)

    next_ids = prefill["core"].argmax(-1)  # [B] one new token per sequence
    decode_core = reference(next_ids, step_metadata(core.BatchMetadata, lengths, [1, 1]), pools["core"])
    decode_prod = production(next_ids, step_metadata(BatchMetadata, lengths, [1, 1]), pools["production"])
    torch.testing.assert_close(decode_core, decode_prod, rtol=1e-5, atol=1e-5)


def test_core_cache_free_prefill_is_the_cached_one():
    """A cache-free forward over whole prompts (the production metadata's for_prompts: the core
    decoder takes it too) gives the last-row logits of a prefill that writes a pool, to
    rounding: the LM head multiplies all T rows there and the B last rows here."""
    cfg = small_config()
    torch.manual_seed(1)
    model = core.Transformer(cfg, core.AttentionBackend("torch")).eval()
    prompt_ids = torch.tensor([t for p in PROMPTS for t in p])  # [T]
    lengths = [len(p) for p in PROMPTS]
    all_rows = model(prompt_ids, BatchMetadata.for_prompts(lengths))  # [T, V]
    cached = model(prompt_ids, step_metadata(core.BatchMetadata, [0, 0], lengths), kv_pool(cfg))  # [B, V]
    torch.testing.assert_close(all_rows[torch.tensor([4, 7])], cached, rtol=1e-5, atol=1e-6)


def test_core_backend_refuses_unknown_names():
    with pytest.raises(ValueError, match="use 'triton' or 'torch'"):
        core.AttentionBackend("invariant")

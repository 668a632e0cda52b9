"""The `minispec` command's model and drafter flags, shared by generate, chat and serve, and the API
field behind each flag (so that an error names what the user typed)."""

from __future__ import annotations

import argparse

# The API field behind each flag, so that an error names what the user typed.
FLAGS = {"num_speculative_tokens": "-k", "prompt_lookup_min": "--lookup-min", "draft_confidence_threshold": "--draft-p-min",
         "ngram_min": "--ngram-min", "ngram_max": "--ngram-max", "max_model_len": "--ctx-size", "temperature": "--temperature",
         "top_p": "--top-p", "top_k": "--top-k", "max_tokens": "--max-tokens", "min_tokens": "--min-tokens",
         "seed": "--seed", "repetition_penalty": "--repeat-penalty", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "stop": "--stop", "dtype": "--dtype", "quantization": "--quantization",
         "draft_quantization": "--draft-quantization", "draft_vocab_size": "--draft-vocab-size",
         "draft_tree_budget": "--tree-budget", "draft_tree_top_k": "--tree-top-k", "pathwise_sampling": "--pathwise-sampling"}


def add_model_arguments(m) -> None:
    """The flags every command shares: the target, the drafter and how they are loaded."""
    m.add_argument("--target", help="target: HF directory or .gguf (default: SmolLM2-135M-Instruct, shipped)")
    m.add_argument("--draft", help="a draft HF directory or .gguf, an EAGLE-3 directory, 'ngram', or 'none' "
                                   "(default: the shipped EAGLE-3 head with the default target, else ngram)")
    m.add_argument("-k", "--num-speculative-tokens", type=int, default=4, dest="k", help="tokens drafted per step, at most (4)")
    m.add_argument("--draft-p-min", type=float, dest="draft_confidence",
                   help="adaptive length: stop drafting after a token the drafter gave p < this (llama.cpp's name); "
                        "with --tree-budget: grow no tree level whose likeliest node has path probability < this")
    m.add_argument("--lookup-min", type=int, help="with a draft model or EAGLE head: draft by prompt lookup where "
                                                 "the last >= N tokens occurred before, by the model elsewhere")
    m.add_argument("--tree-budget", type=int, help="with a draft model or EAGLE-3 head: draft a tree of this many nodes (1..63), "
                                                   "-k levels deep at most, instead of a chain")
    m.add_argument("--tree-top-k", type=int, help="with --tree-budget: children per expanded node (4)")
    m.add_argument("--ngram-min", type=int, help="the n-gram drafter's shortest match (1)")
    m.add_argument("--ngram-max", type=int, help="the n-gram drafter's (or the lookup's) longest match (3)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("--quantization", choices=["int8"], help="int8 weights for target and drafter (exact for the int8 target)")
    m.add_argument("--draft-quantization", choices=["int4"], help="a draft model in int4 (CPU; exact, as any draft is)")
    m.add_argument("--draft-vocab-size", type=int, help="a draft model's LM head over its N most frequent tokens (exact)")
    m.add_argument("--row-invariant", action="store_true", help="CPU: the target computes each row alike whatever "
                                                               "the batch (greedy speculative == plain, bit for bit; slower)")
    m.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, help="share prompt prefixes' K/V (default: serve, chat)")
    m.add_argument("--speculation-by-load", action=argparse.BooleanOptionalAction, help="each step's k from measured costs (default: serve)")
    m.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, help="long prompts a chunk a step (default: serve)")
    m.add_argument("--pathwise-sampling", choices=["off", "seeded", "on"],
                   help="which requests sample by Gumbel-max keyed by (seed, position), so that speculation cannot change "
                        "their tokens: none, seeded ones (default: serve), all (default: off)")
    m.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens a step feeds the target at most, drafts included (512, with chunked prefill); "
                        "without chunks, the prompt tokens a step admits (8192)")
    m.add_argument("-c", "--ctx-size", "--max-model-len", type=int, dest="ctx_size", help="context length (prompt + answer)")
    m.add_argument("-t", "--threads", type=int, help="CPU threads (torch's default otherwise)")

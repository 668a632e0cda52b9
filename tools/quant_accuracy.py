"""How far int8 weights (minispec/fast/int8.py) move the target's logits from its fp32 ones.

    python tools/quant_accuracy.py [--target DIR_OR_GGUF] [--prompts N] [--tokens M]

The fp32 target writes greedy answers to the bench prompts; both models then score every answer
token teacher-forced (one cache-free forward per prompt), and over those positions we report the
max |logit difference|, the mean KL(fp32 || int8) of the next-token distributions, and how often
their top-1 tokens agree. (Speculative decoding with the int8 target is exact for the int8 target;
this measures the price of quantization itself.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402
from minispec import LLM, BatchMetadata, SamplingParams, load_checkpoint  # noqa: E402


@torch.inference_mode()
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF directory or .gguf (default: the bench's SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=40, help="bench prompts to use")
    ap.add_argument("--tokens", type=int, default=48, help="greedy answer tokens per prompt")
    args = ap.parse_args(argv)
    if args.target:
        target = Path(args.target)
    else:
        from minispec.io.paths import default_target

        target = default_target()
    fp32 = load_checkpoint(target, dtype="float32")
    int8 = load_checkpoint(target, dtype="float32", quantization="int8")
    prompts = bench.load_prompts(bench.DEFAULT_PROMPTS, fp32[1], args.prompts)
    answers = LLM(fp32, kv_cache_gib=0.25).generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens))
    max_err, kls, agree, n = 0.0, [], 0, 0
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor(prompt + answer.token_ids)
        rows = slice(len(prompt) - 1, len(ids) - 1)  # the positions that predict answer tokens
        a = fp32[0](ids, BatchMetadata.for_prompts([len(ids)]))[rows]  # [m, V]
        b = int8[0](ids, BatchMetadata.for_prompts([len(ids)]))[rows]
        max_err = max(max_err, (a - b).abs().max().item())
        kls.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1))
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        n += len(a)
    kl = torch.cat(kls)
    result = {"positions": n, "max_abs_logit_error": max_err, "mean_kl": kl.mean().item(),
              "p99_kl": kl.quantile(0.99).item(), "top1_agreement": agree / n}
    print(f"{target.name}, int8 (W8A8, per-channel weights, per-row activations) vs fp32, {len(prompts)} bench prompts, "
          f"{n} answer positions: max |logit error| {max_err:.3f}, mean KL {result['mean_kl']:.4f} "
          f"(p99 {result['p99_kl']:.4f}), top-1 agreement {result['top1_agreement']:.3f}")
    return result


if __name__ == "__main__":
    main()

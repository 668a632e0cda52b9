"""What a step's random draws cost: keyed draws (minispec/randomness.py) against one torch.Generator
per request (minispec before keyed draws), and pathwise sampling's Gumbel-max (minispec/pathwise.py).

A step of B sequences with k drafts each, under the standard rule, takes per sequence k draft
samples, k acceptance uniforms and one final sample:
    generators  each a torch.rand on the request's own generator (the old code's pattern), the
                rows stacked and copied to the device;
    keyed       the same numbers from randomness.uniforms (host integer hashing, one copy each).
The inverse-CDF searches the numbers feed are the same either way and are not timed. Pathwise
sampling instead makes a vocabulary of noise per token decided (k drafts, then the verification
depth by depth over the rows it reaches: one per sequence when the first draft is rejected,
k + 1 when all are accepted) and takes a Gumbel-max over it:
    pathwise    the step's Gumbel-max tokens when the first draft is rejected, and when all are
                accepted (plain pathwise decoding: one row per sequence and token).

Times are the fastest of 15 runs (on a shared machine the median measures the neighbours).

    python tools/randomness_cost.py [--device cpu|cuda] [--vocab 49152 151936] [--batch 1 16] [-k 4] [--kept 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from minispec.pathwise import gumbel_max
from minispec.randomness import Purpose, request_key, uniforms


def draws_with_generators(gens: list[torch.Generator], k: int, device: str) -> None:
    for _ in range(k):  # the drafter: one sample per sequence per position
        torch.stack([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(device)
    accept = torch.zeros(len(gens), k, dtype=torch.float64)
    for b, g in enumerate(gens):  # the verification: k acceptance uniforms, then the final token's
        accept[b] = torch.rand(k, generator=g, dtype=torch.float64)
    accept.to(device)
    torch.stack([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(device)


def keyed_draws(keys: list, k: int, device: str) -> None:
    B, L = len(keys), 100
    for i in range(k):
        uniforms(keys, [L + i] * B, Purpose.DRAFT, device, [L] * B)
    rows = [(key, L + i) for key in keys for i in range(k + 1)]
    uniforms([key for key, _ in rows], [pos for _, pos in rows], Purpose.ACCEPT, device, [L] * len(rows))
    uniforms([key for key, _ in rows], [pos for _, pos in rows], Purpose.TOKEN, device)


def pathwise_tokens(q: torch.Tensor, p: torch.Tensor, keys: list, k: int, rows: int) -> None:
    B, L = len(keys), 100
    for i in range(k):
        gumbel_max(q, keys, [L + i] * B)
    for i in range(rows):  # the verification, depth by depth
        gumbel_max(p[i * B : (i + 1) * B], keys, [L + i] * B)


def fastest_ms(fn, device: str, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--kept", type=int, help="tokens each row keeps (top-k): pathwise noise for those only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = f"{args.kept} tokens kept" if args.kept else "every token kept"
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, k {args.k}, {kept}; fastest ms per step")
    print(f"{'V':>7} {'B':>3} {'generators':>11} {'keyed':>8} {'pathwise reject':>16} {'pathwise accept':>16}")
    for V in args.vocab:
        for B in args.batch:
            g = torch.Generator().manual_seed(0)
            q = torch.rand(B, V, generator=g).softmax(-1).to(args.device)  # [B, V]
            p = torch.rand(B * (args.k + 1), V, generator=g).softmax(-1).to(args.device)  # [B (k+1), V]
            if args.kept:  # a top-k warp's zeros
                q = q * (q >= q.topk(args.kept, dim=-1).values[:, -1:])
                p = p * (p >= p.topk(args.kept, dim=-1).values[:, -1:])
            gens = [torch.Generator().manual_seed(s) for s in range(B)]
            keys = [request_key(s) for s in range(B)]
            old = fastest_ms(lambda: draws_with_generators(gens, args.k, args.device), args.device)
            new = fastest_ms(lambda: keyed_draws(keys, args.k, args.device), args.device)
            reject = fastest_ms(lambda: pathwise_tokens(q, p, keys, args.k, 1), args.device)
            accept = fastest_ms(lambda: pathwise_tokens(q, p, keys, args.k, args.k + 1), args.device)
            print(f"{V:>7} {B:>3} {old:>11.3f} {new:>8.3f} {reject:>16.2f} {accept:>16.2f}")


if __name__ == "__main__":
    main()

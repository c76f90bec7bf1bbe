"""Interleaved A/B of the G' launch's tile-group size (kernels/gemm_softmax.group_m) on a GPU.

    python -m bench.tune_group_m [--rounds 6] [--shapes qwen-0.5b,llama-1b,llama-8b]
        [--groups 8,16,32]

Per shape, CE mean with a trainable head (bench_head's case iii: 4096-row chunks, 32 row tiles)
with GEMM 1's GROUP_M forced to each value, and the floor GEMM X @ Wᵀ, timed in rounds (one
`do_bench` each, in the same order every round) so that every variant sees the GPU's clock and
thermal drift alike. Prints each variant's median ms and the median over rounds of
ms / (3 × that round's floor).
"""

import argparse
import statistics

import torch
import triton.testing

from bench.head import SHAPES
from grpo_lce import linear_cross_entropy
from grpo_lce.kernels import _tuning


def run_shape(name, rounds, groups, base):
    N, H, V = SHAPES[name]
    torch.manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H**-0.5
    y = torch.randint(0, V, (N,), device="cuda")

    def case_iii():
        linear_cross_entropy(x.detach().requires_grad_(), w.detach().requires_grad_(),
                             y).backward()

    variants = {"floor": (None, lambda: x @ w.t())}
    for gm in groups:
        # GROUP_M_MAX = GROUP_M: the rule then keeps exactly this size
        variants[f"GROUP_M={gm}"] = (dict(base, GROUP_M=gm, GROUP_M_MAX=gm), case_iii)
    times = {k: [] for k in variants}
    try:
        for _ in range(rounds):
            for k, (cfg, fn) in variants.items():
                if cfg is not None:
                    _tuning.GEMM_GRAD = cfg
                times[k].append(triton.testing.do_bench(fn, warmup=25, rep=100))
    finally:
        _tuning.GEMM_GRAD = base
    fl = times.pop("floor")
    print(f"{name}: floor median {statistics.median(fl):.3f} ms "
          f"(min {min(fl):.3f}, max {max(fl):.3f})")
    for k, ts in times.items():
        ratios = [t / (3 * f) for t, f in zip(ts, fl)]
        print(f"  {k}: median {statistics.median(ts):.3f} ms, x 3 floors: median over "
              f"rounds {statistics.median(ratios):.3f}, rounds "
              f"{[round(q, 3) for q in ratios]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shapes", default="qwen-0.5b,llama-1b,llama-8b")
    ap.add_argument("--groups", default="8,16,32")
    args = ap.parse_args()
    base = dict(_tuning.GEMM_GRAD)
    print(torch.cuda.get_device_name())
    for name in args.shapes.split(","):
        run_shape(name, args.rounds, [int(g) for g in args.groups.split(",")], base)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

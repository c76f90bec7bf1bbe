"""Sweep the row kernel's launch config and the chunk budget on a GPU; prints a table.

    python -m bench.tune_row            # N=8192, H=2048, V=128256, bf16
The chosen values go into grpo_lce/kernels/_tuning.py and grpo_lce/_chunks.py by hand.
"""

import argparse
import itertools

import torch
import triton.testing

import grpo_lce._chunks as chunks
from grpo_lce import linear_cross_entropy, linear_logprobs
from grpo_lce.kernels import _tuning


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--v", type=int, default=128256)
    args = ap.parse_args()
    N, H, V = args.n, args.h, args.v
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16) * 2
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
    y = torch.randint(0, V, (N,), device="cuda")
    g = torch.randn(N, device="cuda")
    floor = triton.testing.do_bench(lambda: h @ w.t(), warmup=25, rep=100)
    print(f"{torch.cuda.get_device_name()}  N={N} H={H} V={V}  floor GEMM {floor:.2f} ms")
    hg = h.clone().requires_grad_()
    wg = w.clone().requires_grad_()

    def case_i():
        hg.grad = None
        (linear_logprobs(hg, w, y) * g).sum().backward()

    def case_ii():
        with torch.no_grad():
            linear_logprobs(h, w, y, return_entropy=True)

    def case_iii():
        hg.grad = None
        wg.grad = None
        linear_cross_entropy(hg, wg, y).backward()

    def case_iv():
        hg.grad = None
        linear_cross_entropy(hg, w, y).backward()

    cases = {"i": (case_i, 2), "ii": (case_ii, 1), "iii": (case_iii, 3), "iv": (case_iv, 2)}
    budget0 = chunks.DEFAULT_CHUNK_BUDGET_BYTES
    for block, warps, budget_mib in itertools.product(
        (2048, 4096, 8192), (4, 8, 16), (128, 256, 512)
    ):
        if budget_mib != 256 and (block, warps) != (4096, 8):
            continue
        _tuning.ROW_BLOCK_V, _tuning.ROW_NUM_WARPS = block, warps
        chunks.DEFAULT_CHUNK_BUDGET_BYTES = budget_mib * 2**20
        row = []
        for name, (fn, k) in cases.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            row.append(f"{name} {ms:6.2f}ms ({ms / (k * floor):.2f}x{k})")
        print(f"BLOCK_V={block:5d} warps={warps:2d} budget={budget_mib:3d}MiB  " + "  ".join(row))
    chunks.DEFAULT_CHUNK_BUDGET_BYTES = budget0


if __name__ == "__main__":
    main()

"""Sweep the divergence row kernel's launch config and the chunk budget on a GPU.

`grpo_lce.linear_divergence` (method "basis", frozen student and teacher heads, β = 0.5, the
generalized JSD: the mode with the most work per logit), loss forward + backward to dh, at the
Llama-1B and -8B head shapes (N = 8192 rows, V = 128256, bf16). For every combination of

    DIVERGENCE_BLOCK_V   columns per loop step of kernels/divergence_rows.py
    num_warps            of that kernel (it shares ROW_NUM_WARPS with the row kernel now)
    chunk budget         grpo_lce._chunks.DEFAULT_CHUNK_BUDGET_BYTES (rows per chunk follow)

it prints the median ms (`triton.testing.do_bench`) and its multiple of the floor, three bf16
GEMMs of N x H x V with fp32 output (S = h Wᵀ, T = g Uᵀ, the basis G W). The chosen values go into
grpo_lce/kernels/_tuning.py by hand.

    python -m bench.tune_divergence --out-dir bench/results      # under a minute on an H100
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import triton.testing

import grpo_lce._chunks as chunks
from bench import common as bc
from grpo_lce import linear_divergence
from grpo_lce._mm import mm_f32
from grpo_lce.kernels import _tuning

SHAPES = {"1b": (8192, 2048, 128256), "8b": (8192, 4096, 128256)}
BLOCKS = (2048, 4096, 8192)
WARPS = (4, 8, 16)
BUDGETS_MIB = (128, 256, 512)


def _inputs(N, H, V, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    h, t = rand(N, H, scale=2.0), rand(N, H, scale=2.0)
    w, u = rand(V, H, scale=0.02), rand(V, H, scale=0.02)
    return h.requires_grad_(), w, t, u


def sweep(name: str, N: int, H: int, V: int) -> list[dict]:
    h, w, t, u = _inputs(N, H, V)
    floor = triton.testing.do_bench(lambda: mm_f32(h.detach(), w.t()), warmup=25, rep=100)

    def step():
        h.grad = None
        linear_divergence(h, w, t, u, beta=0.5).sum().backward()

    defaults = (_tuning.DIVERGENCE_BLOCK_V, _tuning.ROW_NUM_WARPS,
                chunks.DEFAULT_CHUNK_BUDGET_BYTES)
    rows = []
    print(f"{name}: N={N} H={H} V={V}  floor GEMM {floor:.2f} ms (x3 = {3 * floor:.2f})")
    try:
        for block, warps, budget in itertools.product(BLOCKS, WARPS, BUDGETS_MIB):
            # the budget only with the default launch; the launch only at the default budget
            if budget != 256 and (block, warps) != defaults[:2]:
                continue
            _tuning.DIVERGENCE_BLOCK_V, _tuning.ROW_NUM_WARPS = block, warps
            chunks.DEFAULT_CHUNK_BUDGET_BYTES = budget * 2**20
            try:
                ms = triton.testing.do_bench(step, warmup=10, rep=60)
                err = None
            except Exception as exc:  # e.g. a register spill failing to compile
                ms, err = None, bc.short_error(exc)
            rows.append({"shape": name, "N": N, "H": H, "V": V, "block_v": block,
                         "num_warps": warps, "budget_mib": budget, "ms": ms,
                         "floor_ms": 3 * floor, "error": err})
            label = err if ms is None else f"{ms:7.2f} ms ({ms / (3 * floor):.2f}x floor)"
            print(f"  BLOCK_V={block:5d} warps={warps:2d} budget={budget:3d} MiB  {label}",
                  flush=True)
    finally:
        (_tuning.DIVERGENCE_BLOCK_V, _tuning.ROW_NUM_WARPS,
         chunks.DEFAULT_CHUNK_BUDGET_BYTES) = defaults
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for name in args.shapes.split(","):
        rows += sweep(name, *SHAPES[name])
        bc.free_memory()
    out = Path(args.out_dir) / f"tune_divergence_{bc.gpu_tag('cuda')}.json"
    bc.write_json(out, {"env": bc.env_info(device), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Bench: LoRA's t = x @ Aᵀ formed by add_rmsnorm (`kernels.lora_t`) against the decode linear
forming it in every tile. At 8 rows, per 1B / 8B shape: add_rmsnorm of a SplitSum (2
partials) + residual without factors and with the q/k/v (3) or gate/up (2) factors; the
grouped q/k/v launch and the gate/up + silu · mul launch of the warp-specialized kernel with
t formed in its K loop and with t given; each norm + launch pair as a decode step runs it;
and the norm with factors on 8, 16 and 32 warps (`rmsnorm.t_warps`' choice).
Every call is timed back to back, 40 to a CUDA graph captured inside `pdl.decode_step()` (so
with programmatic dependent launch, as the decode loop launches them), the best of 5 replays;
the weights are one copy (L2-warm where they fit): an A/B of the two paths, not a floor.

GPU, from the project root (the bench/README install line first):

    python3 -m bench.lora_t [--tag _s37]

Prints µs a call; writes bench/results/lora_t_<GPU><tag>.json.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

from bench import common as bc
from trainers.sampling.kernels import linear4bit as L
from trainers.sampling.kernels import linear4bit_ws as WS
from trainers.sampling.kernels import pdl
from trainers.sampling.kernels import rmsnorm as R
from trainers.sampling.kernels.linear4bit import LinearPart, Packed4bit
from trainers.sampling.kernels.rmsnorm import add_rmsnorm
from trainers.sampling.kernels.split_sum import SplitSum

ROWS = 8
# (name, K, output features of each projection, gate/up + silu · mul)
LAUNCHES = [("8b q/k/v", 4096, (4096, 1024, 1024), False),
            ("8b gate/up", 4096, (14336, 14336), True),
            ("1b q/k/v", 2048, (2048, 512, 512), False),
            ("1b gate/up", 2048, (8192, 8192), True)]


def graph_us(fn, n: int = 40, reps: int = 5) -> float:
    """µs a call of fn: n calls captured back to back (with PDL), best of `reps` replays."""
    with pdl.decode_step():
        fn()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / n)
    return best


def _parts(k: int, ns: tuple, dev) -> list:
    """NF4 (double quant, blocksize 64) projections with rank-16 bf16 LoRA factors."""
    import bitsandbytes.functional as F

    parts = []
    for i, n in enumerate(ns):
        g = torch.Generator(device="cpu").manual_seed(i)
        w = (torch.randn(n, k, generator=g) * 0.05).to(dev, torch.bfloat16)
        packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        a = (torch.randn(16, k, generator=g) / k**0.5).to(dev, torch.bfloat16)
        b = (torch.randn(n, 16, generator=g) * 0.1).to(dev, torch.bfloat16)
        parts.append(LinearPart(Packed4bit.from_quant_state(packed, qs), None, a, b, 2.0))
    return parts


def measure(name: str, k: int, ns: tuple, glu: bool, dev) -> dict:
    """One launch's row: the module docstring's timings, µs a call."""
    parts = _parts(k, ns, dev)
    factors = tuple(p.lora_a for p in parts)
    delta = SplitSum(torch.randn(2, ROWS, k, device=dev), None, torch.bfloat16, k)
    r = torch.randn(ROWS, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, device=dev, dtype=torch.bfloat16)
    y, _, t = add_rmsnorm(delta, r, w, 1e-5, lora_a=factors)

    def norm(with_t):
        return add_rmsnorm(delta, r, w, 1e-5, lora_a=factors if with_t else None)

    def linear(x, lora_t):
        if glu:
            return L.linear4bit_lora_silu_mul(x, parts[0], parts[1], lora_t=lora_t)
        return L.linear4bit_lora_group(x, parts, lora_t=lora_t)

    def pair(with_t):
        out = norm(with_t)
        return linear(out[0], out[2] if with_t else None)

    given = WS.LAUNCHES["lora t given"]
    row = {"launch": name, "K": k, "N": list(ns), "factors": len(parts),
           "norm_us": graph_us(lambda: norm(False)),
           "norm_t_us": graph_us(lambda: norm(True)),
           "linear_us": graph_us(lambda: linear(y, None)),
           "linear_given_t_us": graph_us(lambda: linear(y, t)),
           "pair_us": graph_us(lambda: pair(False)),
           "pair_t_us": graph_us(lambda: pair(True))}
    assert WS.LAUNCHES["lora t given"] > given, dict(WS.LAUNCHES)  # the given-t path ran
    for warps in (8, 16, 32):  # the norm's warps with factors (`rmsnorm.t_warps`)
        with mock.patch.object(R, "t_warps", lambda block_p, n=warps: n):
            row[f"norm_t_us_warps{warps}"] = graph_us(lambda: norm(True))
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name, k, ns, glu in LAUNCHES:
        row = measure(name, k, ns, glu, dev)
        print(json.dumps({key: round(v, 2) if isinstance(v, float) else v
                          for key, v in row.items()}), flush=True)
        rows.append(row)
        bc.free_memory()
    bc.write_rows("lora_t", args.tag, dev, rows)


if __name__ == "__main__":
    main()

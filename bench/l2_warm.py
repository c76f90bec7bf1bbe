"""Bench: the warp-specialized decode linear's launches with their weights streamed from HBM
against the same launch repeated on one copy (its weights then L2-resident where they fit): how
much of a launch's time the weight stream's latency and bandwidth explain.

GPU, from the project root (the bench/README install line first):

    python3 -m bench.l2_warm

Per shape, with and without the rank-16 LoRA term: µs a call inside a replayed CUDA graph
cycling over copies larger than twice the L2 ("cold", as a decode step streams its weights)
and over one copy ("warm"). Split-K launches hand their sums on (the decode step's deferred
sum), so each call is one launch. Results: bench/results/l2_warm_<GPU><tag>.json.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench import common as bc
from bench import decode_linear as D
from trainers.sampling.kernels import linear4bit as L
from trainers.sampling.kernels import linear4bit_ws as WS

# (name, (N, K), a gate/up + silu · mul launch of two such projections)
SHAPES = [("8b q/o", (4096, 4096), False), ("8b down", (4096, 14336), False),
          ("8b gate", (14336, 4096), False), ("8b gate/up GLU", (14336, 4096), True),
          ("1b gate/up GLU", (8192, 2048), True), ("1b q/o", (2048, 2048), False)]


def _times(x, copies, scaling: float, glu: bool, lora: bool, device) -> dict:
    """Cold and warm µs of one launch (module docstring) over `copies` of a projection."""
    def part(c):
        return L.LinearPart(c[0], None, c[1] if lora else None, c[2] if lora else None,
                            scaling)

    def call(c, c2):
        return WS._launch(x, [part(c)] + ([part(c2)] if glu else []), glu, True)

    nc = len(copies)
    cold, why = D.graph_ms([lambda i=i: call(copies[i], copies[(i + 1) % nc])
                            for i in range(nc)], device)
    warm, why_warm = D.graph_ms([lambda: call(copies[0], copies[1])], device)
    return {"lora": lora, "copies": nc, "cold_us": cold["ms"] * 1e3 if cold else why,
            "warm_us": warm["ms"] * 1e3 if warm else why_warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for name, (n, k), glu in SHAPES:
        mod = D.make_module(n, k, 16, device)
        copies = D.packed_copies(mod, device)  # (weight, A, B) of each copy
        x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
        for lora in (True, False):
            row = {"shape": name, **_times(x, copies, mod.scaling["default"], glu, lora, device)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del mod, copies
        bc.free_memory()
    bc.write_rows("l2_warm", args.tag, device, rows)


if __name__ == "__main__":
    main()

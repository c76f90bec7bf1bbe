"""Bench: does a warp-specialized decode linear launch take the time of its longest CTA or of
its SMs' share of the work? One K split, the pair table, a rank-16 LoRA term, cold copies
(bench.decode_linear's): gate-like single projections and gate/up + silu · mul launches at N
giving 132 / 192 / 224 / 264 CTAs of 64 rows (one a SM to two a SM on an H100's 132 SMs) and K
of 14 or 16 steps (256 columns each; a gate/up CTA streams both projections: 28 or 32).

GPU, from the project root (the bench/README install line first):

    python3 -m bench.ws_waves
    python3 -m bench.ws_waves --stages 2,3,4 --lora 1,0 --glu 0 --shapes 8448x4096,14336x4096,16896x4096

Prints µs a launch (median inside a replayed CUDA graph) and ns a tile-step (µs over CTAs x
steps); writes bench/results/ws_waves_<GPU><tag>.json. `--stages` sets `linear4bit_ws.STAGES`
(the ring's depth), `--lora 0` drops the LoRA term.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench import common as bc
from bench import decode_linear as D
from trainers.sampling.kernels import linear4bit as L
from trainers.sampling.kernels import linear4bit_ws as WS

SHAPES = [(14336, 4096), (16896, 4096), (8448, 4096), (16896, 3584), (14336, 3584),
          (12288, 4096)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    ap.add_argument("--glu", default="0,1",
                    help="0: single projections, 1: gate/up + silu · mul launches")
    ap.add_argument("--stages", default=str(WS.STAGES))
    ap.add_argument("--lora", default="1")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    WS.PAIR_TABLE = 2  # every shape through the same lookup
    shapes = [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")]
    rows = []
    for glu in (bool(int(v)) for v in args.glu.split(",")):
        for n, k in shapes:
            mod = D.make_module(n, k, 16, dev)
            copies = D.packed_copies(mod, dev)
            s = mod.scaling["default"]
            x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
            for lora in (bool(int(v)) for v in args.lora.split(",")):
                for stages in (int(v) for v in args.stages.split(",")):
                    WS.STAGES = stages

                    def call(c, x=x, s=s, glu=glu, lora=lora):
                        p = L.LinearPart(c[0], None, c[1] if lora else None,
                                         c[2] if lora else None, s)
                        return WS._launch(x, [p, p] if glu else [p], glu, False, split=1)

                    t, why = D.graph_ms([lambda c=c: call(c) for c in copies], dev)
                    r = {"glu": glu, "N": n, "K": k, "lora": lora, "stages": stages,
                         "ctas": n // 64, "steps": k // 256 * (2 if glu else 1),
                         "us": t["ms"] * 1e3 if t else why}
                    if t:
                        r["ns_per_tile_step"] = r["us"] * 1e3 / (r["ctas"] * r["steps"])
                    print(json.dumps(r), flush=True)
                    rows.append(r)
            del mod, copies
            bc.free_memory()
    bc.write_rows("ws_waves", args.tag, dev, rows)


if __name__ == "__main__":
    main()

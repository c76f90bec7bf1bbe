"""The warp-specialized decode linear per launch at other K splits and ring depths (GPU only).

Per shape, `linear4bit.decode_linear` at M rows on a rank-16 NF4 + LoRA layer
(`bench.decode_linear.make_module`), checked against bitsandbytes + PEFT within linear4bit's
bound, then timed as graph replays over copies of the layer twice the L2 (weights from HBM, as
`bench.decode_linear` times it), with `linear4bit_ws`'s module constants set per variant
(STAGES, CTAS_PER_SM / PAIR_CTAS_PER_SM, which set the split, PAIR_TABLE) and restored after.
Each record says how many ws launches the check made (the path ran) and the split the rule
gave. Writes bench/results/ws_knobs_<GPU><tag>.json:

    python3 -m bench.ws_knobs [--rows 8] [--tag _x]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from bench import common as bc
from bench import decode_linear as dl

# (N, K) and the variants: name -> linear4bit_ws constants
VARIANTS = {
    "8b down": ((4096, 14336), {
        "base": {}, "stages3": {"STAGES": 3}, "stages4": {"STAGES": 4},
        "split2": {"PAIR_CTAS_PER_SM": 0.9}, "split8": {"PAIR_CTAS_PER_SM": 3.0},
        "split8 stages3": {"PAIR_CTAS_PER_SM": 3.0, "STAGES": 3}}),
    "8b gate": ((14336, 4096), {
        "base": {}, "stages3": {"STAGES": 3}, "stages4": {"STAGES": 4},
        "split2": {"PAIR_CTAS_PER_SM": 3.0}}),
    "8b q/o": ((4096, 4096), {
        "base": {}, "stages3": {"STAGES": 3}, "split4": {"CTAS_PER_SM": 1.6},
        "pair table split4": {"PAIR_TABLE": 2, "PAIR_CTAS_PER_SM": 1.6},
        "split1": {"CTAS_PER_SM": 0.4}}),
    "1b gate": ((8192, 2048), {
        "base": {}, "stages3": {"STAGES": 3}, "split2": {"CTAS_PER_SM": 1.6}}),
    "1b down": ((2048, 8192), {
        "base": {}, "stages3": {"STAGES": 3}, "split8": {"CTAS_PER_SM": 1.6},
        "split2": {"CTAS_PER_SM": 0.4}}),
}


def measure_shape(ws, decode_linear, n, k, m, variants, device, bw) -> list[dict]:
    """One record a variant of `variants` (name -> constants) for the (N, K) layer at m rows."""
    mod = dl.make_module(n, k, 16, device)
    mods = dl.cold_copies(mod, device)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    floor_ms = dl.floor_bytes(m, n, k, 16, mod.get_base_layer().weight.quant_state) / bw * 1e3
    _, sms = dl.l2_and_sms(device)
    out = []
    for name, knobs in variants.items():
        saved = {key: getattr(ws, key) for key in knobs}
        try:
            for key, v in knobs.items():
                setattr(ws, key, v)
            before = sum(ws.LAUNCHES.values())
            with torch.no_grad():
                dl.check(decode_linear(x, mod), mod(x), x, mod)
                ran = sum(ws.LAUNCHES.values()) - before
                # a variant the ws kernel did not take (fell back) is not timed as if it did
                g, why = (dl.graph_ms([functools.partial(decode_linear, x, c) for c in mods],
                                      device) if ran else
                          (None, "no ws launch: " + (ws._failed[0] if ws._failed else
                                                     "linear4bit_ws.reason declined the call")))
            split = ws.split_rule(n, k, sms)
        finally:
            for key, v in saved.items():
                setattr(ws, key, v)
        out.append({"variant": name, "knobs": knobs, "ws_launches": ran, "split_rule": split,
                    "floor_us": floor_ms * 1e3, "us": g["ms"] * 1e3 if g else None,
                    "na": why})
    del mod, mods
    bc.free_memory()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.ws_knobs times the Hopper kernel: it needs a CUDA GPU")
    from trainers.sampling.kernels import linear4bit_ws as ws
    from trainers.sampling.kernels.linear4bit import decode_linear

    device = torch.device("cuda")
    torch.manual_seed(0)
    bw = dl.hbm_bandwidth(device)
    env = bc.env_info(device)
    rows = []
    for shape, ((n, k), variants) in VARIANTS.items():
        for rec in measure_shape(ws, decode_linear, n, k, args.rows, variants, device, bw):
            rows.append({"shape": shape, "N": n, "K": k, "M": args.rows, **rec})
            print(f"{shape:8} {rec['variant']:20} split {rec['split_rule']}  "
                  f"{rec['us'] or float('nan'):7.2f} µs  floor {rec['floor_us']:6.2f}  "
                  f"ws launches {rec['ws_launches']}", flush=True)
    path = Path(args.out_dir) / f"ws_knobs_{bc.gpu_short_name(device)}{args.tag}.json"
    bc.write_json(path, {"env": env, "bandwidth_Bps": bw, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

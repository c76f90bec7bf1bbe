"""Decode attention alone: `trainers.sampling.decode_attention` against masked SDPA over the
static cache (the decode step's other path, `model_step._attention`) and the floor.

One new token per row over a static bf16 cache of M slots, the 1B shape (8 kv heads of 4 query
heads, D = 64) and the 8B shape (8 of 4, D = 128), every row with `valid` keys (--valid: the
start, middle and end of a 512-token completion after a short prompt). Each variant is captured
in a CUDA graph and timed by its replays (do_bench: L2 flushed between replays):

    decode_attention        the kernel as the decode step runs it (splits combined in-launch)
    torch combine           the same splits, combined by torch ops (config COMBINE=False)
    SDPA, masked cache      torch's SDPA over all M slots with the (B, 1, 1, M) additive mask
    floor                   the valid keys and values, B · H_kv · valid · D · 2 · 2 bytes, at the
                            HBM bandwidth measured in the same run (a 4 GiB device copy)

Before timing, each variant's output against fp32 attention on the same bf16 inputs (its bf16
roundings: `tests/test_sampling_decode_attention.py`'s bound, 2⁻⁷ · max|V|). `--sweep` times the
kernel's SPLIT_N × BLOCK_N × num_warps grid at each point.

    python -m bench.decode_attention                       # 1B and 8B, batch 8 and 64
    python -m bench.decode_attention --sweep --valid 320

Writes bench/results/decode_attention_<GPU>[tag].{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from bench import common as bc
from bench.sample import graph_replay, hbm_bandwidth
from trainers.sampling.decode_attention import decode_attention
from trainers.sampling.model_step import _attention

SHAPES = {"1b": (8, 4, 64), "8b": (8, 4, 128)}  # (H_kv, G, D)
SWEEP = {"SPLIT_N": (64, 128, 256), "BLOCK_N": (16, 32, 64), "num_warps": (2, 4)}


def inputs(B, hkv, G, D, M, valid, device, seed=0):
    """q (B, H_kv, G, D), K, V (B, H_kv, M, D) bf16 (keys past `valid` are garbage: large
    values a masked read would show), last (B,) = valid − 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, hkv, G, D, generator=g, device=device).bfloat16()
    K = torch.randn(B, hkv, M, D, generator=g, device=device).bfloat16()
    V = torch.randn(B, hkv, M, D, generator=g, device=device).bfloat16()
    K[:, :, valid:] = 1e4
    V[:, :, valid:] = 1e4
    last = torch.full((B,), valid - 1, dtype=torch.long, device=device)
    return q, K, V, last


def reference(q, K, V, valid, scale):
    z = torch.einsum("bhgd,bhmd->bhgm", q.float(), K[:, :, :valid].float()) * scale
    return torch.einsum("bhgm,bhmd->bhgd", z.softmax(-1), V[:, :, :valid].float())


def sdpa_call(q, K, V, last, scale):
    """The decode step's SDPA path: q as (B, H, 1, D), the additive mask made once."""
    B, hkv, G, D = q.shape
    M = K.shape[2]
    seen = torch.arange(M, device=q.device)[None, :] <= last[:, None]
    mask = torch.zeros(B, 1, 1, M, dtype=q.dtype, device=q.device).masked_fill_(
        ~seen[:, None, None], float("-inf"))
    qh = q.reshape(B, hkv * G, 1, D)
    return lambda: _attention(qh, K, V, mask, scale).reshape(B, hkv, G, D)


def measure(name, B, valid, slots, bw, device, sweep):
    """(rows, sweep rows) of one point: each variant checked against fp32, then timed."""
    hkv, G, D = SHAPES[name]
    scale = D ** -0.5
    q, K, V, last = inputs(B, hkv, G, D, slots, valid, device)
    ref = reference(q, K, V, valid, scale)
    bound = 2**-7 * V[:, :, :valid].float().abs().max().item()
    variants = {
        "decode_attention": lambda: decode_attention(q, K, V, last, scale=scale),
        "torch combine": lambda: decode_attention(q, K, V, last, scale=scale,
                                                  config={"COMBINE": False}),
        "SDPA, masked cache": sdpa_call(q, K, V, last, scale),
    }
    floor_ms = B * hkv * valid * D * 2 * 2 / bw * 1e3
    point = {"model": name, "B": B, "valid": valid, "slots": slots}
    rows = []
    for variant, fn in variants.items():
        err = (fn().float() - ref).abs().max().item()
        if not err <= bound:
            sys.exit(f"{variant} off by {err:.2e} (bound {bound:.2e}) at {point}")
        t = bc.time_ms(graph_replay(fn), device)
        rows.append({**point, "variant": variant, **t, "floor_ms": floor_ms,
                     "x_floor": t["ms"] / floor_ms, "max_err": err})
    swept = []
    for cfg in (dict(zip(SWEEP, v)) for v in itertools.product(*SWEEP.values())) if sweep \
            else ():
        t = bc.time_ms(graph_replay(lambda cfg=cfg: decode_attention(
            q, K, V, last, scale=scale, config=cfg)), device)
        swept.append({**point, **cfg, **t})
    return rows, swept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b,8b", help="comma list of " + ",".join(SHAPES))
    p.add_argument("--batches", default="8,64")
    p.add_argument("--slots", type=int, default=592, help="cache slots M")
    p.add_argument("--valid", default="64,320,576", help="comma list of valid keys per row")
    p.add_argument("--sweep", action="store_true", help="time the kernel's launch grid")
    p.add_argument("--tag", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type != "cuda":
        p.error("--device: CUDA graphs and do_bench need a GPU")
    env = bc.env_info(device)
    bw = hbm_bandwidth(device)
    res = {"env": env, "args": vars(a), "hbm_bytes_per_s": bw, "rows": [], "sweep": []}
    print(f"{env.get('gpu')}  torch {env['torch']}  triton {env.get('triton')}  commit "
          f"{env['commit']}  HBM copy {bw / 1e9:.0f} GB/s")
    lines = [("| model | B | valid | decode_attention | torch combine | SDPA, masked cache | "
              "floor |"), "|---|---|---|---|---|---|---|"]
    points = itertools.product(a.models.split(","), map(int, a.batches.split(",")),
                               map(int, a.valid.split(",")))
    for name, B, valid in points:
        rows, sweep = measure(name, B, valid, a.slots, bw, device, a.sweep)
        res["rows"] += rows
        res["sweep"] += sweep
        cells = [f"{r['ms'] * 1e3:.1f} µs ({r['x_floor']:.1f}×)" for r in rows]
        lines.append(f"| {name} | {B} | {valid} | " + " | ".join(cells)
                     + f" | {rows[0]['floor_ms'] * 1e3:.1f} µs |")
        print(lines[-1], flush=True)
        if sweep:
            best = min(sweep, key=lambda r: r["ms"])
            print(f"  sweep best: {best['ms'] * 1e3:.1f} µs at SPLIT_N {best['SPLIT_N']}, "
                  f"BLOCK_N {best['BLOCK_N']}, {best['num_warps']} warps", flush=True)
        bc.free_memory()
    stem = Path(a.out_dir) / f"decode_attention_{bc.gpu_short_name(device)}{a.tag}"
    bc.write_report(stem, f"decode attention, bf16 cache of {a.slots} slots; {env.get('gpu')}, "
                    f"torch {env['torch']}, triton {env.get('triton')}, commit {env['commit']}; "
                    f"HBM copy {bw / 1e9:.0f} GB/s; graph replays, × the floor in brackets\n\n"
                    + "\n".join(lines) + "\n", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

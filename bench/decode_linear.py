"""Decode linear benchmark: the fused 4-bit + LoRA kernel against bitsandbytes + PEFT and the floor.

Per layer shape (N, K) of Llama-3.2-1B and Llama-3.1-8B (q, k/v, gate/up, down; o is q's shape),
NF4 with double-quant absmax (bitsandbytes' QLoRA default), LoRA r = 16 (α = 32, bf16 factors),
and M = 1, 8, 64, 256 rows of bf16 x:

    ours      trainers.sampling.kernels.linear4bit.decode_linear(x, lora.Linear4bit)
    bnb+peft  the same PEFT module's forward (bitsandbytes gemv_4bit at M = 1, dequantize to a
              bf16 copy + cuBLAS above; PEFT's two LoRA GEMMs, scale and add)
    floor     bytes that must move ÷ HBM bandwidth: packed weight N·K/2 + absmax (N·K/64 uint8
              + fp32 second-level scales) + A, B (r·(K + N)·2) + x and y; the bandwidth is
              measured in the same run by a 1 GiB device-to-device copy (read + write)

each timed eagerly (`triton.testing.do_bench`, L2 flushed) and as a replay of a CUDA graph of
at least 20 calls (what the decode loop runs; launch overhead amortized) that cycle through
copies of the layer holding more than twice the L2 (so the weights come from HBM, as in a
decode step), median ms with the 20-80 % spread. Before timing, ours is checked against bnb+peft within the bound of linear4bit's
docstring; the run aborts if it is off.

GPU (from the project root, `.whl/` filled by ../shared/gpu/wheels.sh and carried):

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; python3 -m bench.decode_linear

Tile sweep (graph-replay ms of the kernel over BLOCK_N × SPLIT_K × num_warps × num_stages):
`python3 -m bench.decode_linear --sweep --rows 8`.
CPU smoke run (Triton's interpreter, tiny shapes): `python -m bench.decode_linear --smoke`.
Writes bench/results/bench_decode_linear_<GPU>.json and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
from pathlib import Path

import torch

from bench import common as bc

SHAPES = {
    "1b": {"q/o": (2048, 2048), "k/v": (512, 2048), "gate/up": (8192, 2048),
           "down": (2048, 8192)},
    "8b": {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096),
           "down": (4096, 14336)},
}
SMOKE_SHAPES = {"tiny": {"q/o": (128, 256), "down": (64, 512)}}
# how many projections of a decoder layer have each shape (q and o; k and v; gate and up; down)
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
GRAPH_CALLS = 20


def hbm_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (2 GiB moved)."""
    n = (2**30 if device.type == "cuda" else 2**22) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = bc.time_ms(functools.partial(dst.copy_, src), device)
    del src, dst
    bc.free_memory()
    return 2 * n * 4 / (t["ms"] * 1e-3)


def floor_bytes(m, n, k, r, qs) -> int:
    absmax = qs.absmax.numel() * qs.absmax.element_size()
    if qs.nested:
        absmax += qs.state2.absmax.numel() * 4 + qs.state2.code.numel() * 4
    return n * k // 2 + absmax + 16 * 4 + r * (k + n) * 2 + m * (k + n) * 2


def make_module(n, k, r, device):
    import bitsandbytes as bnb
    from peft import LoraConfig
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    base = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    base.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",
                                    compress_statistics=True)
    if device.type == "cpu":
        base.weight = base.weight._quantize("cpu")
        # keep bitsandbytes' CPU forward from repacking the weight in place (AVX512 layout)
        base.support_avx512bf16_for_cpu = False
    mod = LoraLinear4bit(base, "default", LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05),
                         r=r, lora_alpha=2 * r)
    mod = mod.to(device)
    mod.lora_A["default"].to(torch.bfloat16)
    mod.lora_B["default"].to(torch.bfloat16)
    with torch.no_grad():
        mod.lora_B["default"].weight.normal_(0, 0.02)
    return mod.eval()


def check(ours, ref, x, mod):
    """ours within 4u|y| + (4u + 2K·2⁻²⁴)·S of bnb+peft (linear4bit's docstring)."""
    from bitsandbytes import functional as bnbF

    base = mod.get_base_layer()
    w = bnbF.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
    a, b = mod.lora_A["default"].weight.float(), mod.lora_B["default"].weight.float()
    xa = x.float().abs()
    big_s = xa @ w.abs().T + mod.scaling["default"] * (xa @ a.abs().T) @ b.abs().T
    u, k = 2.0**-8, x.shape[1]
    tol = 4 * u * ref.float().abs() + (4 * u + 2 * (k + 20) * 2.0**-24) * big_s
    err = (ours.float() - ref.float()).abs()
    if not (err <= tol).all():
        raise SystemExit(f"ours is off: max err {err.max().item():.3g}, "
                         f"worst err/tol {(err / tol).max().item():.3g}")


def graph_ms(fns, device):
    """Median ms of one call inside a replayed CUDA graph of max(GRAPH_CALLS, len(fns)) calls
    that cycle through `fns` (None off CUDA or if capture fails, with the reason)."""
    if device.type != "cuda":
        return None, "no CUDA"
    calls = [fns[i % len(fns)] for i in range(max(GRAPH_CALLS, len(fns)))]
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
    except Exception as e:  # noqa: BLE001 (a competitor that can't be captured is an n/a row)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    t = bc.time_ms(graph.replay, device)
    return {k: (v / len(calls) if k in ("ms", "p20", "p80") else v) for k, v in t.items()}, None


def cold_copies(mod, device):
    """`mod` and deep copies of it, enough that the graph's calls stream more than twice the L2
    from HBM (as a decode step does: a whole model's weights never stay in L2), at most 256."""
    if device.type != "cuda":
        return [mod]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    packed = mod.get_base_layer().weight.data.numel()
    n = min(256, max(1, -(-2 * l2 // packed)))
    return [mod] + [copy.deepcopy(mod) for _ in range(n - 1)]


def layer_summary(results) -> list[dict]:
    """Per model and M: the seven projections of one decoder layer (PER_LAYER), summed: ours and
    bnb+peft (graph times where captured) against the summed floor."""
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        for m in dict.fromkeys(r["M"] for r in results):
            rs = [r for r in results if r["model"] == model and r["M"] == m]
            mult = [PER_LAYER.get(r["layer"], 1) for r in rs]
            best = lambda r, key: (r[key + "_graph"] or r[key])["ms"]
            floor = sum(c * r["floor_ms"] for c, r in zip(mult, rs))
            ours = sum(c * best(r, "ours") for c, r in zip(mult, rs))
            ref = sum(c * best(r, "bnb_peft") for c, r in zip(mult, rs))
            out.append({"model": model, "M": m, "floor_ms": floor, "ours_ms": ours,
                        "bnb_peft_ms": ref, "ours_over_floor": ours / floor,
                        "speedup": ref / ours})
            print(f"{model:5} one decoder layer's projections, M={m:3}: floor {floor:.4f} ms, "
                  f"ours {ours:.4f} ms ({ours / floor:.2f}x floor), bnb+peft {ref:.4f} ms "
                  f"({ref / ours:.2f}x ours)")
    return out


def sweep_configs(k, blocksize=64):
    """The tile grid `--sweep` times: BLOCK_N × SPLIT_K × num_warps × num_stages at BLOCK_K 128
    (the unpacked codes and their gather pointers already take ~250 registers a thread at
    BLOCK_N 64 with 4 warps; BLOCK_K 256 spills)."""
    import triton

    bk = max(128, blocksize)
    for bn in (32, 64, 128):
        for split in sorted({1, 2, 4, 8, 16} & set(range(1, triton.cdiv(k, bk) + 1))):
            for warps in (4, 8):
                for stages in (2, 3):
                    yield {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
                           "num_stages": stages}


def sweep(shapes, rows, rank, device, bw):
    """Graph-replay ms of linear4bit_lora under every config of `sweep_configs`, per shape and
    M; prints the chosen config (pick_config) and the three fastest."""
    import triton

    from trainers.sampling.kernels.linear4bit import Packed4bit, linear4bit_lora, pick_config

    out = []
    for model, layers in shapes.items():
        for layer, (n, k) in layers.items():
            mod = make_module(n, k, rank, device)
            base = mod.get_base_layer()
            copies = [(Packed4bit.from_quant_state(c.get_base_layer().weight.data,
                                                   c.get_base_layer().weight.quant_state),
                       c.lora_A["default"].weight, c.lora_B["default"].weight)
                      for c in cold_copies(mod, device)]
            w = copies[0][0]
            for m in rows:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                floor_ms = floor_bytes(m, n, k, rank, base.weight.quant_state) / bw * 1e3
                bm = min(64, max(16, triton.next_power_of_2(m)))
                chosen = pick_config(m, n, k, w.blocksize, torch.cuda.get_device_properties(
                    device).multi_processor_count if device.type == "cuda" else 1)
                times = []
                for cfg in [chosen, *sweep_configs(k, w.blocksize)]:
                    cfg = {"BLOCK_M": bm, **cfg}
                    fns = [functools.partial(linear4bit_lora, x, cw, lora_a=ca, lora_b=cb,
                                             scaling=2.0, config=cfg) for cw, ca, cb in copies]
                    t, _ = graph_ms(fns, device)
                    t = t or bc.time_ms(fns[0], device)
                    times.append((t["ms"], cfg))
                t_chosen = times[0][0]
                times.sort(key=lambda v: v[0])
                rec = {"model": model, "layer": layer, "N": n, "K": k, "M": m,
                       "floor_ms": floor_ms, "chosen": chosen, "chosen_ms": t_chosen,
                       "best": [{"ms": ms, "config": c} for ms, c in times[:3]]}
                out.append(rec)
                print(f"{model:5} {layer:8} M={m:3} floor {floor_ms:.4f}  chosen "
                      f"{t_chosen:.4f} ({t_chosen / floor_ms:.2f}x)  best {times[0][0]:.4f} "
                      f"({times[0][0] / floor_ms:.2f}x) {times[0][1]}")
            del mod, copies
            bc.free_memory()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1b,8b", help="comma list of 1b, 8b")
    p.add_argument("--rows", default="1,8,64,256", help="comma list of M")
    p.add_argument("--rank", type=int, default=16, help="LoRA r")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter run)")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR), help="where the JSON goes")
    p.add_argument("--sweep", action="store_true",
                   help="time our kernel over a grid of tile configs instead (use with --rows 8)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before our kernels import triton
    from trainers.sampling.kernels.linear4bit import decode_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else {m: SHAPES[m] for m in args.models.split(",")}
    rows = [1, 8] if args.smoke else [int(v) for v in args.rows.split(",")]
    bw = hbm_bandwidth(device)
    env = bc.env_info(device)
    for pkg in ("bitsandbytes", "peft", "transformers"):
        env[pkg] = bc.package_version(pkg)
    print(f"{env['gpu'] or 'cpu'}  copy bandwidth {bw / 1e9:.0f} GB/s  commit {env['commit']}")
    if args.sweep:
        res = sweep(shapes, rows, args.rank, device, bw)
        path = Path(args.out_dir) / f"bench_decode_linear_sweep_{bc.gpu_short_name(device)}.json"
        bc.write_json(path, {"env": env, "bandwidth_Bps": bw, "rank": args.rank,
                             "results": res})
        print(f"wrote {path}")
        return
    hdr = (f"{'model':5} {'layer':8} {'N':>6} {'K':>6} {'M':>4} {'floor':>7} | "
           f"{'ours':>14} {'graph':>7} {'x floor':>7} | {'bnb+peft':>14} {'graph':>7} | "
           f"{'speedup':>7}")
    print(hdr + "\n" + "-" * len(hdr))
    results = []
    for model, layers in shapes.items():
        for layer, (n, k) in layers.items():
            mod = make_module(n, k, args.rank, device)
            mods = cold_copies(mod, device)
            qs = mod.get_base_layer().weight.quant_state
            for m in rows:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                with torch.no_grad():
                    ours_fn = functools.partial(decode_linear, x, mod)
                    ref_fn = functools.partial(mod, x)
                    check(ours_fn(), ref_fn(), x, mod)
                    t_ours = bc.time_ms(ours_fn, device)
                    t_ref = bc.time_ms(ref_fn, device)
                    g_ours, why_o = graph_ms(
                        [functools.partial(decode_linear, x, c) for c in mods], device)
                    g_ref, why_r = graph_ms([functools.partial(c, x) for c in mods], device)
                fb = floor_bytes(m, n, k, args.rank, qs)
                floor_ms = fb / bw * 1e3
                best_ours = (g_ours or t_ours)["ms"]
                best_ref = (g_ref or t_ref)["ms"]
                rec = {"model": model, "layer": layer, "N": n, "K": k, "M": m,
                       "floor_bytes": fb, "floor_ms": floor_ms, "ours": t_ours,
                       "ours_graph": g_ours, "ours_graph_na": why_o, "bnb_peft": t_ref,
                       "bnb_peft_graph": g_ref, "bnb_peft_graph_na": why_r,
                       "ours_over_floor": best_ours / floor_ms, "speedup": best_ref / best_ours}
                results.append(rec)

                def fmt(t):
                    return f"{t['ms']:.4f}±{t['spread_pct']:.0f}%" if t else "n/a"

                print(f"{model:5} {layer:8} {n:6} {k:6} {m:4} {floor_ms:7.4f} | "
                      f"{fmt(t_ours):>14} {g_ours['ms'] if g_ours else float('nan'):7.4f} "
                      f"{rec['ours_over_floor']:7.2f} | {fmt(t_ref):>14} "
                      f"{g_ref['ms'] if g_ref else float('nan'):7.4f} | {rec['speedup']:7.2f}")
            del mod, mods
            bc.free_memory()
    summary = layer_summary(results)
    path = Path(args.out_dir) / f"bench_decode_linear_{bc.gpu_short_name(device)}.json"
    bc.write_json(path, {"env": env, "bandwidth_Bps": bw, "graph_calls": GRAPH_CALLS,
                         "rank": args.rank, "results": results,
                         "per_decoder_layer": summary})
    print(f"x floor and speedup use the graph times where captured; wrote {path}")


if __name__ == "__main__":
    main()

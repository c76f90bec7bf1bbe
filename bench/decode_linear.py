"""Decode linear benchmark: the fused 4-bit + LoRA kernel against bitsandbytes + PEFT and the floor.

Per layer shape (N, K) of Llama-3.2-1B and Llama-3.1-8B (q, k/v, gate/up, down; o is q's shape),
NF4 with double-quant absmax (bitsandbytes' QLoRA default), LoRA r = 16 (α = 32, bf16 factors),
and M = 1, 8, 64, 256 rows of bf16 x:

    ours      trainers.sampling.kernels.linear4bit.decode_linear(x, lora.Linear4bit)
    bnb+peft  the same PEFT module's forward (bitsandbytes gemv_4bit at M = 1, dequantize to a
              bf16 copy + cuBLAS above; PEFT's two LoRA GEMMs, scale and add)
    grouped   q/k/v and gate/up through `decode_linears` (one launch each, as the decode step
              runs them); the per-layer line adds o and down. For gate/up also the MLP's
              silu(gate) · up: the grouped launch then torch's silu and mul (three launches),
              and `decode_silu_mul` (one launch; on the GPU checked bit for bit against the three)
    floor     bytes that must move ÷ HBM bandwidth: packed weight N·K/2 + absmax (N·K/64 uint8
              + fp32 second-level scales) + A, B (r·(K + N)·2) + x and y; the bandwidth is
              measured in the same run by a 1 GiB device-to-device copy (read + write)

each timed eagerly (`triton.testing.do_bench`, L2 flushed) and as a replay of a CUDA graph of
at least 20 calls (what the decode loop runs; launch overhead amortized) that cycle through
copies of the layer holding more than twice the L2 (so the weights come from HBM, as in a
decode step), median ms with the 20-80 % spread; ours also as a graph captured inside
`pdl.decode_step()` (its launches with PDL, as the decode loop runs them). The floor of any
launch: an empty kernel of one program a SM (`bench.empty_launch`), replayed the same way, plain
and with PDL. A launch that does nothing but read a row's floor bytes (`bench.read_kernel`, its
fastest of READ_CONFIGS), each call its own slice of a pool of about four times the L2, replayed
the same way: the "read" column; also at READ_SIZES_MB, with the line through those points (a
launch's fixed cost and the streaming rate). Before timing, ours is checked against bnb+peft
within the bound of linear4bit's docstring; the run aborts if it is off.

GPU (from the project root, `.whl/` filled by ../shared/gpu/wheels.sh and carried):

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; python3 -m bench.decode_linear

Tile sweep (graph-replay ms of the kernel over BLOCK_N × num_warps × SPLIT_K):
`python3 -m bench.decode_linear --sweep --rows 8`; `--gathers` also times every tile with the
code looked up by memory gathers, `--prefetch` with and without PREFETCH (`--prefetch-only`:
with it only), `--stages 1,2` the pipeline depths, `--tiles 64x4,128x4` restricts the
(BLOCK_N, num_warps) pairs, `--maxnreg 0,128` caps the registers per thread (0: none),
`--groups` sweeps the q/k/v launch and the gate/up + silu · mul launch instead of the single
shapes, `--reg-tile 0,1` also (1: only) the register tile (its own splits; BLOCK_M 16).
`--block-steps` times our kernel with one absmax block a step at every M (pick_config's
`reg_tile=False`), the comparison with the register tile it takes up to 16 rows; `--tag` is
appended to the result file's name.
CPU smoke run (Triton's interpreter, tiny shapes): `python -m bench.decode_linear --smoke`.
Writes bench/results/bench_decode_linear_<GPU>.json and prints the table.

`--rope` times the decode step's other fused piece instead, per layer: RoPE of q and k with the
write of k and v into the KV cache (`kernels.rope.rope_cache_write`, one launch) against the torch
ops it replaces in `ModelStep` (`_rope` of q and of k, two index_put writes; Qwen3's q_norm and
k_norm before them on the qwen3-8b shape), at the Llama-3.2-1B (32 q / 8 kv heads of 64),
Llama-3.1-8B and Qwen3-8B (32 / 8 heads of 128) shapes, a cache of ROPE_CACHE slots, M = --rows.
Both are checked first (bit for bit without norms, the rope module's bound with them), then timed
eagerly and as a graph of one call per layer of the model, each on its own layer's cache (the per-step
cost); the floor is the bytes read and written ÷ the copy bandwidth. Writes
bench/results/bench_decode_rope_<GPU>.json:

    python3 -m bench.decode_linear --rope --rows 1,8,64,256
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
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
SMOKE_SHAPES = {"tiny": {"q/o": (128, 256), "k/v": (32, 256), "gate/up": (256, 256),
                         "down": (64, 512)}}
# how many projections of a decoder layer have each shape (q and o; k and v; gate and up; down)
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
# the projections of one input that the decode step runs in one launch (decode_linears), by the
# shapes above; with them a layer is q/k/v + o + gate/up + down
GROUPS = {"q/k/v": ("q/o", "k/v", "k/v"), "gate/up": ("gate/up", "gate/up")}
REST_OF_LAYER = {"q/o": 1, "down": 1}  # o and down: one launch each
GRAPH_CALLS = 20
# the pure read's (programs a SM, int32 words a program reads per loop step, warps a program),
# at most 64 warps a SM (all resident); the fastest counts
READ_CONFIGS = tuple((p, b, w) for p, b, w in itertools.product(
    (8, 16, 32), (512, 1024, 2048, 4096), (2, 4)) if p * w <= 64)
READ_SIZES_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
# (q heads, kv heads, head dim, layers, Qwen3 q/k norms)
ROPE_SHAPES = {"1b": (32, 8, 64, 16, False), "8b": (32, 8, 128, 32, False),
               "qwen3-8b": (32, 8, 128, 36, True)}
SMOKE_ROPE_SHAPES = {"tiny": (4, 2, 16, 2, False), "tiny-norm": (4, 2, 16, 2, True)}
ROPE_CACHE = 1024


def hbm_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (2 GiB moved)."""
    n = (2**30 if device.type == "cuda" else 2**22) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = bc.time_ms(functools.partial(dst.copy_, src), device)
    del src, dst
    bc.free_memory()
    return 2 * n * 4 / (t["ms"] * 1e-3)


def launch_floor(device, ctas: int) -> dict:
    """Graph-replay ms of a launch of `ctas` programs that do nothing (the least a kernel of the
    chain costs, whatever it reads), plain and with PDL, or why not; {} off CUDA."""
    if device.type != "cuda":
        return {}
    from bench.empty_launch import empty_kernel
    from trainers.sampling.kernels.pdl import launch_args

    def launch():
        empty_kernel[(ctas,)](**launch_args(empty_kernel, device))
    out = {}
    for key, pdl in (("plain", False), ("pdl", True)):
        t, why = graph_ms([launch], device, pdl=pdl)
        out[key] = t or {"na": why}
    return out


def read_calls(device, nbytes: int, programs_per_sm: int, block: int, warps: int = 4) -> list:
    """Launches of `bench.read_kernel` over `nbytes` (rounded up to int32 words), one a call,
    each on its own slice of a pool of about four times the L2 (at least one slice), enough
    calls that a graph cycling through them reads more than twice the L2 before it reads a
    slice again (at most 1024 calls): every read comes from HBM, as a decode linear's weights
    do."""
    l2, sms = l2_and_sms(device)
    words = -(-nbytes // 4)
    stride = -(-words // 128) * 128  # 512-byte aligned slices
    slices = max(1, 4 * l2 // (4 * stride))
    pool = torch.randint(-2**31, 2**31 - 1, (slices * stride,), dtype=torch.int32,
                         device=device)
    grid = min(programs_per_sm * sms, -(-words // block))
    out = torch.empty(grid, dtype=torch.int32, device=device)
    calls = min(1024, max(GRAPH_CALLS, -(-2 * l2 // nbytes)))
    return [functools.partial(read_words, pool[(i % slices) * stride:], out, words, block, warps)
            for i in range(calls)]


def l2_and_sms(device) -> tuple[int, int]:
    """The device's L2 bytes and SM count (64 KiB and 2 off CUDA: the CPU tests' stand-ins)."""
    if device.type != "cuda":
        return 2**16, 2
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "L2_cache_size", 50 * 2**20), props.multi_processor_count


def read_words(src: torch.Tensor, out: torch.Tensor, words: int, block: int,
               warps: int = 4) -> None:
    """One launch of `bench.read_kernel` of out.numel() programs over src[:words] (int32):
    the XOR of out is then the XOR of those words."""
    from bench.read_kernel import read_kernel

    read_kernel[(out.numel(),)](src, out, words, BLOCK=block, num_warps=warps)


@functools.cache  # shapes of equal bytes (1B gate/up and down) are timed once
def read_floor(device, nbytes: int) -> dict:
    """The fastest graph-replay time over READ_CONFIGS of a kernel that only reads `nbytes`
    from HBM (`read_calls`): a launch that does nothing else, its launch and first loads'
    latency included ({'ms', ..., 'programs_per_sm', 'block', 'warps'}, or {'na': why});
    {} off CUDA."""
    if device.type != "cuda":
        return {}
    best, why = None, None
    for pps, block, warps in READ_CONFIGS:
        t, why = graph_ms(read_calls(device, nbytes, pps, block, warps), device)
        if t is not None and (best is None or t["ms"] < best["ms"]):
            best = {**t, "programs_per_sm": pps, "block": block, "warps": warps}
    bc.free_memory()
    return best or {"na": why}


def read_sweep(device, sizes_mb=READ_SIZES_MB) -> dict:
    """`read_floor` at each size, and the least-squares line ms = fixed + bytes / rate through
    them: a launch's fixed cost (µs) and the streaming rate (GB/s); {} off CUDA."""
    if device.type != "cuda":
        return {}
    pts = [(int(mb * 2**20), read_floor(device, int(mb * 2**20))) for mb in sizes_mb]
    out = {"points": [{"bytes": b, **t} for b, t in pts]}
    line = fixed_and_rate([(b, t["ms"]) for b, t in pts if "ms" in t])
    if line is not None:
        out.update(fixed_us=line[0], rate_GBps=line[1])
    return out


def fixed_and_rate(points) -> tuple[float, float] | None:
    """The least-squares line ms = fixed + bytes / rate through (bytes, ms) points: (fixed in
    µs, rate in GB/s), or None for fewer than two distinct sizes or no positive slope."""
    xs, ys = [float(b) for b, _ in points], [float(t) for _, t in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
             / sum((x - mx) ** 2 for x in xs))
    if slope <= 0:
        return None
    return (my - slope * mx) * 1e3, 1e-6 / slope


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


def graph_ms(fns, device, pdl: bool = False):
    """Median ms of one call inside a replayed CUDA graph of max(GRAPH_CALLS, len(fns)) calls
    that cycle through `fns` (None off CUDA or if capture fails, with the reason); pdl: captured
    inside `pdl.decode_step()`, so our kernels launch with PDL as the decode loop runs them
    (each starts while the one before finishes; the 4-bit linear's first weight copies overlap
    it)."""
    if device.type != "cuda":
        return None, "no CUDA"
    from trainers.sampling.kernels.pdl import decode_step

    calls = [fns[i % len(fns)] for i in range(max(GRAPH_CALLS, len(fns)))]
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), (decode_step() if pdl else contextlib.nullcontext()):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), (decode_step() if pdl else contextlib.nullcontext()):
            for fn in calls:
                fn()
    except Exception as e:  # noqa: BLE001 (a competitor that can't be captured is an n/a row)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    t = bc.time_ms(graph.replay, device)
    return {k: (v / len(calls) if k in ("ms", "p20", "p80") else v) for k, v in t.items()}, None


def cold_sets(mods: list, device) -> list[list]:
    """`mods` and deep copies of the list, enough sets that a graph cycling through them streams
    more than twice the L2 from HBM (as a decode step does: a whole model's weights never stay
    in L2), at most 256."""
    if device.type != "cuda":
        return [mods]
    l2, _ = l2_and_sms(device)
    packed = sum(md.get_base_layer().weight.data.numel() for md in mods)
    n = min(256, max(1, -(-2 * l2 // packed)))
    return [mods] + [copy.deepcopy(mods) for _ in range(n - 1)]


def cold_copies(mod, device):
    """`mod` and its copies of `cold_sets`."""
    return [st[0] for st in cold_sets([mod], device)]


def packed_part(mod):
    """(Packed4bit, lora_A weight, lora_B weight) of a `make_module` layer: what
    `linear4bit_lora` reads."""
    from trainers.sampling.kernels.linear4bit import Packed4bit

    base = mod.get_base_layer()
    return (Packed4bit.from_quant_state(base.weight.data, base.weight.quant_state),
            mod.lora_A["default"].weight, mod.lora_B["default"].weight)


def packed_copies(mod, device) -> list:
    """`packed_part` of each of `cold_copies(mod, device)`."""
    return [packed_part(c) for c in cold_copies(mod, device)]


def layer_summary(results, groups=()) -> list[dict]:
    """Per model and M: the seven projections of one decoder layer (PER_LAYER), summed: ours and
    bnb+peft (graph times where captured) against the summed floor; with `groups` records, also
    ours as the decode step runs it: the q/k/v and gate/up launches, o and down."""
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        for m in dict.fromkeys(r["M"] for r in results):
            rs = [r for r in results if r["model"] == model and r["M"] == m]
            mult = [PER_LAYER.get(r["layer"], 1) for r in rs]
            best = lambda r, key: (r[key + "_graph"] or r[key])["ms"]
            floor = sum(c * r["floor_ms"] for c, r in zip(mult, rs))
            ours = sum(c * best(r, "ours") for c, r in zip(mult, rs))
            ref = sum(c * best(r, "bnb_peft") for c, r in zip(mult, rs))
            rec = {"model": model, "M": m, "floor_ms": floor, "ours_ms": ours,
                   "bnb_peft_ms": ref, "ours_over_floor": ours / floor, "speedup": ref / ours}
            if all("ms" in r.get("read_graph", {}) for r in rs):
                rec["read_ms"] = sum(c * r["read_graph"]["ms"] for c, r in zip(mult, rs))
            gs = [g for g in groups if g["model"] == model and g["M"] == m]
            grouped = ""
            if len(gs) == len(GROUPS):
                rest = sum(c * best(r, "ours") for r in rs
                           for c in [REST_OF_LAYER.get(r["layer"], 0)])
                rec["ours_grouped_ms"] = sum(g["ours_graph"]["ms"] for g in gs) + rest
                grouped = (f", grouped {rec['ours_grouped_ms']:.4f} ms "
                           f"({rec['ours_grouped_ms'] / floor:.2f}x)")
                reads = [g["read_graph"] for g in gs] + [
                    r["read_graph"] for r in rs for _ in range(REST_OF_LAYER.get(r["layer"], 0))]
                if all("ms" in t for t in reads):  # the same launches that only read
                    rec["read_grouped_ms"] = sum(t["ms"] for t in reads)
                    grouped += (f" (launches that only read its bytes: "
                                f"{rec['read_grouped_ms']:.4f} ms)")
                glu = [g["silu_mul_graph"] for g in gs if "silu_mul_graph" in g]
                if glu:  # the MLP's silu · mul too: unfused (3 launches) vs in the gate/up one
                    others = sum(g["ours_graph"]["ms"] for g in gs if "silu_mul_graph" not in g)
                    for key in ("unfused", "fused"):
                        rec[f"ours_layer_silu_mul_{key}_ms"] = others + rest + glu[0][key]["ms"]
                    grouped += (f"; with silu·mul {rec['ours_layer_silu_mul_unfused_ms']:.4f}"
                                f" ms unfused, {rec['ours_layer_silu_mul_fused_ms']:.4f} fused")
            out.append(rec)
            read = f", read alone {rec['read_ms']:.4f}" if "read_ms" in rec else ""
            print(f"{model:5} one decoder layer's projections, M={m:3}: floor {floor:.4f} ms{read}, "
                  f"ours {ours:.4f} ms ({ours / floor:.2f}x floor){grouped}, bnb+peft "
                  f"{ref:.4f} ms ({ref / ours:.2f}x ours)")
    return out


def group_sets(shapes, rank, device):
    """(model, group name, the members' (N, K), modules, cold sets) for each GROUPS launch that
    `shapes` holds: the modules and enough copies of them to stream 2x the L2 (`cold_sets`).
    Their memory is freed before the next group's is made, once the caller has dropped its
    references."""
    for model, layers in shapes.items():
        for name, members in GROUPS.items():
            if not all(mb in layers for mb in members):
                continue
            mods = [make_module(*layers[mb], rank, device) for mb in members]
            sets = cold_sets(mods, device)
            yield model, name, [layers[mb] for mb in members], mods, sets
            del mods, sets
            bc.free_memory()


def replay_ms(fn, x, sets, mods, device) -> tuple[dict, str | None]:
    """(ms, why no graph) of fn(x, set) replayed over the cold sets in a graph, or timed
    eagerly on `mods` where no graph could be captured."""
    g, why = graph_ms([functools.partial(fn, x, st) for st in sets], device)
    return g or bc.time_ms(functools.partial(fn, x, mods), device), why


def grouped(shapes, rows, rank, device) -> list[dict]:
    """Graph-replay ms of `decode_linears` on each GROUPS set of modules (one launch), checked
    against each module's forward first, over enough copies of the set to stream 2x the L2."""
    from trainers.sampling.kernels import linear4bit as L
    from trainers.sampling.kernels import linear4bit_ws
    from trainers.sampling.kernels.linear4bit import decode_linears, decode_silu_mul

    def unfused(x, mods):
        g, u = decode_linears(x, mods)
        return torch.nn.functional.silu(g) * u

    def fused_and_unfused(x, mods):
        """(decode_silu_mul's output, silu(gate) · up of the two projections with the same
        fp32 sums): on the warp-specialized kernel each projection alone (a CTA's K loop over
        the gate's rows is the same loop), on the register tile the fused launch's tiles (its K
        split fixes the order of each sum)"""
        parts, _ = L._group_parts(mods, x.dtype, x.device)
        before = linear4bit_ws.LAUNCHES["silu_mul"]
        h = decode_silu_mul(x, *mods)
        if linear4bit_ws.LAUNCHES["silu_mul"] > before:
            g, u = (L.linear4bit_lora_group(x, [p])[0] for p in parts)
        else:
            cfg = L.pick_config(x.shape[0], [p.weight.shape[0] for p in parts], x.shape[1],
                                parts[0].weight.blocksize, L._num_sms(x.device), glu=True)
            g, u = L.linear4bit_lora_group(x, parts, config=cfg)
        return h, torch.nn.functional.silu(g) * u

    out = []
    for model, name, nks, mods, sets in group_sets(shapes, rank, device):
        k = nks[0][1]
        for m in rows:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            with torch.no_grad():
                for md, y in zip(mods, decode_linears(x, mods)):
                    check(y, md(x), x, md)
                g, why = replay_ms(decode_linears, x, sets, mods, device)
                g_pdl = graph_ms([functools.partial(decode_linears, x, st) for st in sets],
                                 device, pdl=True)[0]
            fb = sum(floor_bytes(m, md.get_base_layer().out_features, k, rank,
                                 md.get_base_layer().weight.quant_state) for md in mods)
            rec = {"model": model, "group": name, "members": list(GROUPS[name]), "M": m,
                   "floor_bytes": fb, "read_graph": read_floor(device, fb),
                   "ours_graph": g, "ours_graph_na": why, "ours_graph_pdl": g_pdl}
            msg = ""
            if name == "gate/up":
                with torch.no_grad():
                    # bit for bit on the GPU with the same tiles (libdevice's expf, as
                    # torch's); the interpreter's exp is numpy's (the CPU tests bound it)
                    if device.type == "cuda" and not torch.equal(*fused_and_unfused(x, mods)):
                        raise AssertionError("decode_silu_mul is not silu(gate) * up")
                    rec["silu_mul_graph"] = {
                        key: replay_ms(fn, x, sets, mods, device)[0]
                        for key, fn in (("unfused", unfused),
                                        ("fused", lambda x, st: decode_silu_mul(x, *st)))}
                    rec["silu_mul_graph_pdl"] = graph_ms(
                        [functools.partial(decode_silu_mul, x, *st) for st in sets], device,
                        pdl=True)[0]
                t, t_pdl = rec["silu_mul_graph"], rec["silu_mul_graph_pdl"]
                msg = (f"; with silu·mul {t['unfused']['ms']:.4f} ms in 3 launches, "
                       f"{t['fused']['ms']:.4f} in 1"
                       + (f" ({t_pdl['ms']:.4f} with PDL)" if t_pdl else ""))
            out.append(rec)
            pdl_msg = f" ({g_pdl['ms']:.4f} with PDL)" if g_pdl else ""
            print(f"{model:5} {name:8} one launch, M={m:3}: {g['ms']:.4f} ms{pdl_msg}{msg}")
        del mods, sets  # group_sets frees them
    return out


TILES = ((64, 4), (128, 4), (128, 8), (256, 8))  # (BLOCK_N, num_warps) that --sweep times


def sweep_configs(k, blocksize=64, lookups=(True,), prefetch=(False,), stages=(1,),
                  tiles=TILES, maxnreg=(None,), reg_tile=(False,)):
    """The grid `--sweep` times: (BLOCK_N, num_warps) in `tiles` × SPLIT_K, for each code lookup
    in `lookups` (PRMT True: register byte permutes; False: memory gathers), PREFETCH (the next
    block's loads issued before this block's math) in `prefetch`, num_stages in `stages`, the
    register cap in `maxnreg` (None: the compiler's choice); with True in `reg_tile` also the
    register tile (64 rows on 4 warps, BLOCK_M 16; its splits divide steps of 256 columns)."""
    for prmt, pf, st, reg, rt in itertools.product(lookups, prefetch, stages, maxnreg, reg_tile):
        steps = -(-k // 256) if rt else k // blocksize
        for bn, warps in ((64, 4),) if rt else tiles:
            for split in sorted({1, 2, 4, 8, 16, 32, 64} & set(range(1, steps + 1))):
                yield {"BLOCK_N": bn, "SPLIT_K": split, "num_warps": warps, "num_stages": st,
                       "PRMT": prmt, "PREFETCH": pf, "maxnreg": reg, "REG_TILE": rt}


def _time_configs(calls, configs, device) -> list[tuple[float, dict]]:
    """[(graph-replay ms, config)] of `calls(config)` (one call per copy of the weights) for each
    config, in the order of `configs`."""
    times = []
    for cfg in configs:
        fns = calls(cfg)
        t, _ = graph_ms(fns, device)
        t = t or bc.time_ms(fns[0], device)
        times.append((t["ms"], cfg))
    return times


def _record(times, base: dict, floor_ms: float | None) -> dict:
    """A sweep record: the chosen (first) config's time, the three fastest, every time."""
    t_chosen, chosen = times[0]
    ranked = sorted(times, key=lambda v: v[0])
    rec = {**base, "floor_ms": floor_ms, "chosen": chosen, "chosen_ms": t_chosen,
           "best": [{"ms": ms, "config": c} for ms, c in ranked[:3]],
           "all": [{"ms": ms, "config": c} for ms, c in ranked]}
    floor = f"floor {floor_ms:.4f}  " if floor_ms else ""
    print(f"{base['model']:5} {base['layer']:8} M={base['M']:3} {floor}chosen {t_chosen:.4f}  "
          f"best {ranked[0][0]:.4f} {ranked[0][1]}")
    return rec


def sweep(shapes, rows, rank, device, bw, grid: dict, save=None):
    """Graph-replay ms of linear4bit_lora under every config of `sweep_configs`, per shape and
    M (every config's time in the record); prints the chosen config (pick_config) and the
    fastest; `save(records)` after each record (a run cut short keeps what it measured)."""
    import triton

    from trainers.sampling.kernels.linear4bit import _num_sms, linear4bit_lora, pick_config

    out = []
    for model, layers in shapes.items():
        for layer, (n, k) in layers.items():
            mod = make_module(n, k, rank, device)
            base = mod.get_base_layer()
            copies = packed_copies(mod, device)
            w = copies[0][0]
            for m in rows:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                floor_ms = floor_bytes(m, n, k, rank, base.weight.quant_state) / bw * 1e3
                bm = min(64, max(16, triton.next_power_of_2(m)))
                chosen = pick_config(m, n, k, w.blocksize, _num_sms(device))
                configs = [chosen] + [{"BLOCK_M": bm, **c}
                                      for c in sweep_configs(k, w.blocksize, **grid)]

                def calls(cfg, x=x, copies=copies):
                    return [functools.partial(linear4bit_lora, x, cw, lora_a=ca, lora_b=cb,
                                              scaling=2.0, config=cfg) for cw, ca, cb in copies]

                out.append(_record(_time_configs(calls, configs, device),
                                   {"model": model, "layer": layer, "N": n, "K": k, "M": m},
                                   floor_ms))
                if save:
                    save(out)
            del mod, copies
            bc.free_memory()
    return out


def sweep_groups(shapes, rows, rank, device, grid: dict, save=None):
    """The same for the GROUPS launches as the decode step runs them (`linear4bit_lora_group`
    over q/k/v, `linear4bit_lora_silu_mul` over gate/up), over copies of each set of modules
    streaming 2x the L2; `save(records)` after each record."""
    import triton

    from trainers.sampling.kernels.linear4bit import (
        LinearPart,
        _num_sms,
        linear4bit_lora_group,
        linear4bit_lora_silu_mul,
        pick_config,
    )

    def silu_mul(x, parts, config):
        return linear4bit_lora_silu_mul(x, *parts, config=config)

    out = []
    for model, name, nks, mods, sets in group_sets(shapes, rank, device):
        parts = [[LinearPart(w, None, a, b, 2.0) for w, a, b in map(packed_part, st)]
                 for st in sets]
        ns, k = [n for n, _ in nks], nks[0][1]
        bs = parts[0][0].weight.blocksize
        fn = silu_mul if name == "gate/up" else linear4bit_lora_group
        for m in rows:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            bm = min(64, max(16, triton.next_power_of_2(m)))
            chosen = pick_config(m, ns, k, bs, _num_sms(device), glu=name == "gate/up")
            configs = [chosen] + [{"BLOCK_M": bm, **c} for c in sweep_configs(k, bs, **grid)]

            def calls(cfg, x=x, parts=parts, fn=fn):
                return [functools.partial(fn, x, ps, config=cfg) for ps in parts]

            out.append(_record(_time_configs(calls, configs, device),
                               {"model": model, "layer": name, "N": sum(ns), "K": k, "M": m},
                               None))
            if save:
                save(out)
        del mods, sets, parts  # group_sets frees them
    return out


def rope_parts(m, hq, hkv, d, layers, norm, device):
    """One decode step's inputs at one layer shape: the projections' (M, 1, H·D) outputs viewed
    (M, H, D), cos / sin (M, D) of Llama-3.1's rotary embedding at random positions, `layers`
    caches (M, Hkv, ROPE_CACHE, D) and slots; Qwen3 norm (weight, eps) pairs if `norm`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    dt = torch.bfloat16
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv,
                      head_dim=d, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    pos = torch.randint(0, ROPE_CACHE, (m, 1), device=device)
    cos, sin = LlamaRotaryEmbedding(cfg).to(device)(torch.zeros(1, dtype=dt, device=device), pos)
    qkv = [torch.randn(m, 1, h * d, device=device).to(dt).view(m, h, d) for h in (hq, hkv, hkv)]
    caches = [[torch.zeros(m, hkv, ROPE_CACHE, d, dtype=dt, device=device) for _ in range(2)]
              for _ in range(layers)]
    norms = [(1 + 0.3 * torch.randn(d, device=device)).to(dt) for _ in range(2)] if norm else None
    return qkv, cos[:, 0], sin[:, 0], caches, pos[:, 0], norms


def rope_torch_ops(q, k, v, cos, sin, ck, cv, slots, norms):
    """What ModelStep runs without the kernel: (q/k norm,) `_rope` of q and of k on the
    (B, H, 1, D) views, then the cache's two index_put writes."""
    from trainers.sampling.kernels.rope import _norm_torch
    from trainers.sampling.model_step import _rope

    if norms is not None:
        q, k = _norm_torch(q, (norms[0], 1e-6)), _norm_torch(k, (norms[1], 1e-6))
    c, s = cos[:, None], sin[:, None]  # (B, 1, D): _rope's (B, S, D)
    q4, k4 = _rope(q[:, :, None], c, s), _rope(k[:, :, None], c, s)
    rows = torch.arange(q.shape[0], device=q.device)
    ck[rows, :, slots] = k4[:, :, 0]
    cv[rows, :, slots] = v
    return q4


def rope_main(args, shapes, rows, device, bw, env):
    from trainers.sampling.kernels.rope import rope_cache_write

    hdr = (f"{'shape':9} {'M':>4} {'floor':>7} | {'fused':>14} {'graph':>7} {'x floor':>7} | "
           f"{'torch ops':>14} {'graph':>7} | {'speedup':>7} {'per step':>9}")
    print(hdr + "\n" + "-" * len(hdr))
    results = []
    for name, (hq, hkv, d, layers, norm) in shapes.items():
        for m in rows:
            (q, k, v), cos, sin, caches, slots, norms = rope_parts(m, hq, hkv, d, layers, norm,
                                                                   device)
            nk = (None, None) if norms is None else ((norms[0], 1e-6), (norms[1], 1e-6))
            ours = [functools.partial(rope_cache_write, q, k, v, cos, sin, ck, cv, slots,
                                      q_norm=nk[0], k_norm=nk[1]) for ck, cv in caches]
            ref = [functools.partial(rope_torch_ops, q, k, v, cos, sin, ck, cv, slots, norms)
                   for ck, cv in caches]
            with torch.no_grad():
                written = (torch.arange(m, device=device), slice(None), slots)
                q_ours = ours[0]()
                k_ours = caches[0][0][written].clone()
                q_ref = ref[0]()[:, :, 0]
                k_ref = caches[0][0][written]
                exact = torch.equal(q_ours, q_ref) and torch.equal(k_ours, k_ref)
                if norms is None and not exact:
                    raise SystemExit(f"{name} M={m}: the fused RoPE differs from the torch ops")
                if norms is not None:
                    # the rope module's bound, about 2⁻⁵ · T_i in bf16, T_i = |y_i cos_i| +
                    # |y_j sin_i| <= |y_i| + |y_j| <= 2 max |rope(y)| over the head (the rotation
                    # keeps y_i² + y_j²; |cos|, |sin| <= 1 for llama3)
                    tol = 2.0**-4 * (q_ref.float().abs() + q_ref.float().abs().amax(-1, True))
                    if not ((q_ours.float() - q_ref.float()).abs() <= tol).all():
                        raise SystemExit(f"{name} M={m}: the fused norm + RoPE is off")
                t_ours, t_ref = bc.time_ms(ours[0], device), bc.time_ms(ref[0], device)
                g_ours, why_o = graph_ms(ours, device)
                g_ref, why_r = graph_ms(ref, device)
            el = 2  # bf16 bytes
            # read q, k, v, cos, sin; write q and the k, v slots (v read once, written once)
            fb = m * el * ((hq + 2 * hkv) * d + 2 * d + (hq + 2 * hkv) * d)
            floor_ms = fb / bw * 1e3
            best_o, best_r = (g_ours or t_ours)["ms"], (g_ref or t_ref)["ms"]
            rec = {"shape": name, "Hq": hq, "Hkv": hkv, "D": d, "layers": layers, "norm": norm,
                   "M": m, "floor_bytes": fb, "floor_ms": floor_ms, "fused": t_ours,
                   "fused_graph": g_ours, "fused_graph_na": why_o, "torch_ops": t_ref,
                   "torch_ops_graph": g_ref, "torch_ops_graph_na": why_r,
                   "fused_over_floor": best_o / floor_ms, "speedup": best_r / best_o,
                   "per_step_saved_ms": layers * (best_r - best_o)}
            results.append(rec)

            def fmt(t):
                return f"{t['ms']:.4f}±{t['spread_pct']:.0f}%" if t else "n/a"

            print(f"{name:9} {m:4} {floor_ms:7.4f} | {fmt(t_ours):>14} "
                  f"{g_ours['ms'] if g_ours else float('nan'):7.4f} "
                  f"{rec['fused_over_floor']:7.2f} | {fmt(t_ref):>14} "
                  f"{g_ref['ms'] if g_ref else float('nan'):7.4f} | {rec['speedup']:7.2f} "
                  f"{rec['per_step_saved_ms']:8.4f}ms")
            del caches
            bc.free_memory()
    path = Path(args.out_dir) / f"bench_decode_rope_{bc.gpu_short_name(device)}.json"
    bc.write_json(path, {"env": env, "bandwidth_Bps": bw, "cache_slots": ROPE_CACHE,
                         "results": results})
    print(f"graph ms are per call (one call per layer); 'per step' = layers x (torch - fused); "
          f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1b,8b", help="comma list of 1b, 8b")
    p.add_argument("--rows", default="1,8,64,256", help="comma list of M")
    p.add_argument("--rank", type=int, default=16, help="LoRA r")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter run)")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR), help="where the JSON goes")
    p.add_argument("--sweep", action="store_true",
                   help="time our kernel over a grid of tile configs instead (use with --rows 8)")
    p.add_argument("--gathers", action="store_true",
                   help="--sweep: also every tile with the code looked up by memory gathers")
    p.add_argument("--prefetch", action="store_true",
                   help="--sweep: also every tile with PREFETCH (loads one block ahead)")
    p.add_argument("--prefetch-only", action="store_true",
                   help="--sweep: PREFETCH on only (as pick_config runs the kernel)")
    p.add_argument("--stages", default="1", help="--sweep: comma list of num_stages")
    p.add_argument("--maxnreg", default="0",
                   help="--sweep: comma list of register caps per thread (0: none)")
    p.add_argument("--tiles", default=",".join(f"{b}x{w}" for b, w in TILES),
                   help="--sweep: comma list of BLOCK_NxNUM_WARPS")
    p.add_argument("--reg-tile", default="0",
                   help="--sweep: comma list of REG_TILE values (1: the register tile, BLOCK_M "
                        "16 only)")
    p.add_argument("--groups", action="store_true",
                   help="--sweep: the q/k/v and gate/up launches (one each) instead of the shapes")
    p.add_argument("--rope", action="store_true",
                   help="time the fused RoPE + KV-cache write against the torch ops instead")
    p.add_argument("--block-steps", action="store_true",
                   help="our kernel with one absmax block a step at every M (pick_config's "
                        "reg_tile=False), to compare with the register tile it takes up to 16 rows")
    p.add_argument("--tag", default="", help="suffix of the result file's name")
    args = p.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before our kernels import triton
    from trainers.sampling.kernels import linear4bit
    from trainers.sampling.kernels.linear4bit import decode_linear

    if args.block_steps:  # every launch of ours picks its tiles through this name
        linear4bit.pick_config = functools.partial(linear4bit.pick_config, reg_tile=False)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else {m: SHAPES[m] for m in args.models.split(",")}
    rows = [1, 8] if args.smoke else [int(v) for v in args.rows.split(",")]
    bw = hbm_bandwidth(device)
    env = bc.env_info(device)
    for pkg in ("bitsandbytes", "peft", "transformers"):
        env[pkg] = bc.package_version(pkg)
    print(f"{env['gpu'] or 'cpu'}  copy bandwidth {bw / 1e9:.0f} GB/s  commit {env['commit']}")
    if args.rope:
        rope_shapes = SMOKE_ROPE_SHAPES if args.smoke else \
            {k: v for k, v in ROPE_SHAPES.items() if k.split("-")[-1] in args.models.split(",")}
        rope_main(args, rope_shapes, rows, device, bw, env)
        return
    if args.sweep:
        gpu = device.type == "cuda"
        grid = {"lookups": (True, False) if args.gathers and gpu else (gpu,),
                "prefetch": ((True,) if args.prefetch_only else
                             (False, True) if args.prefetch else (False,)),
                "stages": tuple(int(v) for v in args.stages.split(",")),
                "maxnreg": tuple(int(v) or None for v in args.maxnreg.split(",")),
                "tiles": tuple(tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")),
                "reg_tile": tuple(bool(int(v)) for v in args.reg_tile.split(","))}
        kind = "sweep_groups" if args.groups else "sweep"
        path = (Path(args.out_dir) /
                f"bench_decode_linear_{kind}_{bc.gpu_short_name(device)}{args.tag}.json")

        def save(res):
            bc.write_json(path, {"env": env, "bandwidth_Bps": bw, "rank": args.rank,
                                 "results": res})

        if args.groups:
            sweep_groups(shapes, rows, args.rank, device, grid, save)
        else:
            sweep(shapes, rows, args.rank, device, bw, grid, save)
        print(f"wrote {path}")
        return
    empty = launch_floor(device, l2_and_sms(device)[1])
    if empty:
        print("an empty launch of one program a SM in a graph: " + ", ".join(
            f"{key} {t['ms']:.4f} ms" if "ms" in t else f"{key} n/a ({t['na']})"
            for key, t in empty.items()))
    reads = read_sweep(device)
    if reads:
        print("a kernel that only reads B bytes, graph ms: " + ", ".join(
            f"{p['bytes'] / 2**20:g} MiB {p['ms']:.4f}" if "ms" in p else
            f"{p['bytes'] / 2**20:g} MiB n/a" for p in reads["points"]))
        if "fixed_us" in reads:
            print(f"  least squares: {reads['fixed_us']:.2f} µs + bytes at "
                  f"{reads['rate_GBps']:.0f} GB/s")
    hdr = (f"{'model':5} {'layer':8} {'N':>6} {'K':>6} {'M':>4} {'floor':>7} {'read':>7} | "
           f"{'ours':>14} {'graph':>7} {'x floor':>7} {'pdl':>7} {'x floor':>7} | "
           f"{'bnb+peft':>14} {'graph':>7} | {'speedup':>7}")
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
                    ours_calls = [functools.partial(decode_linear, x, c) for c in mods]
                    g_ours, why_o = graph_ms(ours_calls, device)
                    g_pdl, _ = graph_ms(ours_calls, device, pdl=True)
                    g_ref, why_r = graph_ms([functools.partial(c, x) for c in mods], device)
                fb = floor_bytes(m, n, k, args.rank, qs)
                floor_ms = fb / bw * 1e3
                read = read_floor(device, fb)
                best_ours = (g_ours or t_ours)["ms"]
                best_ref = (g_ref or t_ref)["ms"]
                rec = {"model": model, "layer": layer, "N": n, "K": k, "M": m,
                       "floor_bytes": fb, "floor_ms": floor_ms, "read_graph": read,
                       "read_over_floor": read["ms"] / floor_ms if "ms" in read else None,
                       "ours": t_ours,
                       "ours_graph": g_ours, "ours_graph_na": why_o, "ours_graph_pdl": g_pdl,
                       "ours_over_floor_pdl": g_pdl["ms"] / floor_ms if g_pdl else None,
                       "bnb_peft": t_ref,
                       "bnb_peft_graph": g_ref, "bnb_peft_graph_na": why_r,
                       "ours_over_floor": best_ours / floor_ms, "speedup": best_ref / best_ours}
                results.append(rec)

                def fmt(t):
                    return f"{t['ms']:.4f}±{t['spread_pct']:.0f}%" if t else "n/a"

                print(f"{model:5} {layer:8} {n:6} {k:6} {m:4} {floor_ms:7.4f} "
                      f"{read.get('ms', float('nan')):7.4f} | "
                      f"{fmt(t_ours):>14} {g_ours['ms'] if g_ours else float('nan'):7.4f} "
                      f"{rec['ours_over_floor']:7.2f} "
                      f"{g_pdl['ms'] if g_pdl else float('nan'):7.4f} "
                      f"{rec['ours_over_floor_pdl'] or float('nan'):7.2f} | {fmt(t_ref):>14} "
                      f"{g_ref['ms'] if g_ref else float('nan'):7.4f} | {rec['speedup']:7.2f}")
            del mod, mods
            bc.free_memory()
    groups = grouped(shapes, rows, args.rank, device)
    summary = layer_summary(results, groups)
    path = Path(args.out_dir) / f"bench_decode_linear_{bc.gpu_short_name(device)}{args.tag}.json"
    bc.write_json(path, {"env": env, "bandwidth_Bps": bw, "graph_calls": GRAPH_CALLS,
                         "empty_launch": empty, "read_sweep": reads,
                         "block_steps": args.block_steps,
                         "rank": args.rank, "results": results, "groups": groups,
                         "per_decoder_layer": summary})
    print(f"x floor and speedup use the graph times where captured; wrote {path}")


if __name__ == "__main__":
    main()

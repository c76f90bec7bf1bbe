"""Decode-linear variants side by side: the lab sweep behind linear4bit's transposed kernel.

One kernel `k5`, holding the output tile transposed (yᵀ += W_tile @ xᵀ) and reading x and
LoRA A with stride 2 (their even and odd columns), with two switches:

    DEQ       0: one gather per packed byte from a 256-entry int64 table of both nibbles' fp32
              codes (2 KB: a warp's gather touches many L1 lines); 1: one gather per nibble from
              the 16-entry fp32 code (one 64-byte line); 2: as 1 but the bf16-rounded code in
              the dot and the block's scale applied to the dot's result (not bitsandbytes'
              rounding of code · scale)
    PREFETCH  the next absmax block's packed bytes and scales loaded before this block's math
              (DEQ 1 only)

each timed (graph replay over cold copies, as bench.decode_linear) at each layer shape of
Llama-3.2-1B and Llama-3.1-8B over BLOCK_N × num_warps × SPLIT_K, beside the product's
`linear4bit_lora` as the checkout has it (`cur`), and `stream`: a kernel that only reads the
packed weight in the same tiles (what the access pattern alone costs). Before timing, each
(DEQ, PREFETCH) is checked against bitsandbytes + PEFT within linear4bit's bound (DEQ 2, which
rounds otherwise, prints its max error instead).

    python3 -m bench.decode_linear_variants 1b,8b 8,64     # models, rows; JSON to $OUT or /tmp
"""

import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl

from bench import common as bc
from bench.decode_linear import (
    SHAPES,
    check,
    floor_bytes,
    graph_ms,
    hbm_bandwidth,
    make_module,
    packed_copies,
)
from trainers.sampling.kernels.linear4bit import (
    _split_k_reduce_kernel,
    linear4bit_lora,
    split_steps,
)


@triton.jit
def k5(
    x_ptr, w_ptr, lut_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, a_ptr, b_ptr,
    part_ptr, M, N, K, R, BLOCKS_PER_SPLIT, scaling,
    stride_xm, stride_ar, stride_bn, stride_ps, stride_pm,
    BS: tl.constexpr, BS2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, PREFETCH: tl.constexpr, DEQ: tl.constexpr,
):
    """Partial sums (split, M, N) of x @ round(W)ᵀ + s · (x @ Aᵀ) @ Bᵀ, double-quant absmax.
    DEQ 0: lut (256,) int64, the high nibble's fp32 code in the low word, the low nibble's in
    the high word; DEQ 1, 2: lut is the 16-entry code."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    HB: tl.constexpr = BS // 2
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, HB)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    n_ok = offs_n < N
    r_ok = offs_r < R
    KB = K // BS
    n_blk = offs_n.to(tl.int64) * KB
    offset = tl.load(offset_ptr)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    blk_lo = pid_k * BLOCKS_PER_SPLIT
    blk_hi = tl.minimum(blk_lo + BLOCKS_PER_SPLIT, KB)
    if PREFETCH:
        ablk = n_blk + blk_lo
        qa = tl.load(absmax_ptr + ablk, mask=n_ok, other=0)
        a2 = tl.load(absmax2_ptr + ablk // BS2, mask=n_ok, other=0.0)
        p = tl.load(w_ptr + (ablk * HB)[:, None] + offs_j[None, :], mask=n_ok[:, None], other=0)
    for blk in range(blk_lo, blk_hi):
        if PREFETCH:
            nxt = n_blk + tl.minimum(blk + 1, blk_hi - 1)
            qa_n = tl.load(absmax_ptr + nxt, mask=n_ok, other=0)
            a2_n = tl.load(absmax2_ptr + nxt // BS2, mask=n_ok, other=0.0)
            p_n = tl.load(w_ptr + (nxt * HB)[:, None] + offs_j[None, :], mask=n_ok[:, None],
                          other=0)
        else:
            ablk = n_blk + blk
            qa = tl.load(absmax_ptr + ablk, mask=n_ok, other=0)
            a2 = tl.load(absmax2_ptr + ablk // BS2, mask=n_ok, other=0.0)
            p = tl.load(w_ptr + (ablk * HB)[:, None] + offs_j[None, :], mask=n_ok[:, None],
                        other=0)
        scale = tl.load(code2_ptr + qa.to(tl.int32)) * a2 + offset
        if DEQ == 0:
            pair = tl.load(lut_ptr + p.to(tl.int32))  # int64
            c_hi = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            c_lo = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            c_hi = tl.load(lut_ptr + (p >> 4).to(tl.int32))
            c_lo = tl.load(lut_ptr + (p & 15).to(tl.int32))
        k_even = blk * BS + 2 * offs_j
        x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_even[None, :],
                         mask=m_ok[:, None], other=0.0)
        x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k_even + 1)[None, :],
                        mask=m_ok[:, None], other=0.0)
        if DEQ == 2:
            blk_acc = tl.dot(c_hi.to(tl.bfloat16), tl.trans(x_even))
            blk_acc = tl.dot(c_lo.to(tl.bfloat16), tl.trans(x_odd), blk_acc)
            acc += blk_acc * scale[:, None]
        else:
            acc += tl.dot((c_hi * scale[:, None]).to(tl.bfloat16), tl.trans(x_even))
            acc += tl.dot((c_lo * scale[:, None]).to(tl.bfloat16), tl.trans(x_odd))
        a_even = tl.load(a_ptr + offs_r[:, None] * stride_ar + k_even[None, :],
                         mask=r_ok[:, None], other=0.0)
        a_odd = tl.load(a_ptr + offs_r[:, None] * stride_ar + (k_even + 1)[None, :],
                        mask=r_ok[:, None], other=0.0)
        t += tl.dot(x_even, tl.trans(a_even))
        t += tl.dot(x_odd, tl.trans(a_odd))
        if PREFETCH:
            qa = qa_n
            a2 = a2_n
            p = p_n
    b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    acc += scaling * tl.dot(b.to(tl.float32), tl.trans(t), input_precision="ieee")
    tl.store(part_ptr + pid_k * stride_ps + offs_m[None, :] * stride_pm + offs_n[:, None], acc,
             mask=m_ok[None, :] & n_ok[:, None])


_LUT = {}


def pair_lut(code):
    """DEQ 0's table for this code tensor (built once per tensor)."""
    key = code.data_ptr()
    if key not in _LUT:
        bits = code.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        b = torch.arange(256, device=code.device)
        _LUT[key] = (bits[b & 15] << 32) | bits[b >> 4]
    return _LUT[key]


def k5_call(x, w, a, b, scaling, bn, split, warps, pf, deq):
    """y (M, N) through k5 and linear4bit's split-K reduction."""
    n, k = w.shape
    m = x.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    per, split_k = split_steps(k // w.blocksize, split)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    k5[(1, triton.cdiv(n, bn), split_k)](
        x, w.packed, pair_lut(w.code) if deq == 0 else w.code, w.absmax, w.code2, w.absmax2,
        w.offset, a, b, part, m, n, k, a.shape[0], per, float(scaling),
        x.stride(0), a.stride(0), b.stride(0), part.stride(0), part.stride(1),
        BS=w.blocksize, BS2=w.blocksize2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=16, PREFETCH=pf,
        DEQ=deq, enable_fp_fusion=False, num_warps=warps, num_stages=1)
    _split_k_reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, 64))](
        part, y, y, m, n, split_k, part.stride(0), part.stride(1), y.stride(0),
        HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=64, INTERP=False)
    return y


@triton.jit
def stream_kernel(w_ptr, out_ptr, N, K, BPS, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The packed bytes of k5's tiles summed per row: their reads and nothing else."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    HB: tl.constexpr = BS // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, HB)
    KB = K // BS
    n_blk = offs_n.to(tl.int64) * KB
    acc = tl.zeros((BLOCK_N, HB), dtype=tl.int32)
    lo = pid_k * BPS
    for blk in range(lo, tl.minimum(lo + BPS, KB)):
        acc += tl.load(w_ptr + ((n_blk + blk) * HB)[:, None] + offs_j[None, :]).to(tl.int32)
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, 1))


def stream_call(w, bn, split, warps):
    n, k = w.shape
    per, split_k = split_steps(k // w.blocksize, split)
    out = torch.empty(split_k, n, device=w.packed.device, dtype=torch.int32)
    stream_kernel[(1, n // bn, split_k)](w.packed, out, n, k, per, BS=w.blocksize, BLOCK_N=bn,
                                         num_warps=warps)
    return out


def save(bw, out):
    """The records so far, to $OUT/lin_variants.json (or /tmp)."""
    path = os.path.join(os.environ.get("OUT", "/tmp"), "lin_variants.json")
    with open(path, "w") as f:
        json.dump({"bw": bw, "gpu": torch.cuda.get_device_name(), "results": out}, f, indent=1)


def variants(splits):
    """(name, deq, prefetch, BLOCK_N, warps, split) of every timed k5 configuration."""
    for deq in (0, 1, 2):
        for pf in (False, True) if deq == 1 else (False,):
            for bn, warps in ((64, 4), (64, 8), (128, 4), (128, 8), (256, 8)):
                for s in splits:
                    yield f"d{deq} bn{bn} w{warps} pf{int(pf)} s{s}", deq, pf, bn, warps, s


def check_variants(x, ref, mod, w, a, b):
    """Each (DEQ, PREFETCH) against bitsandbytes + PEFT (linear4bit's bound; DEQ 2: its error)."""
    for deq, pf in ((0, False), (1, False), (1, True), (2, False)):
        ours = k5_call(x, w, a, b, mod.scaling["default"], 128, 4, 4, pf, deq)
        err = (ours.float() - ref.float()).abs().max().item()
        try:
            if deq < 2:
                check(ours, ref, x, mod)
            print(f"d{deq} pf{int(pf)}: max err {err:.3g} (|ref| max "
                  f"{ref.float().abs().max().item():.3g})", flush=True)
        except SystemExit as e:
            print(f"CHECK FAILED d{deq} pf{int(pf)}: {e}", flush=True)


def best_line(res, prefix, top):
    ranked = sorted((v, k) for k, v in res.items() if v is not None and k.startswith(prefix))
    return ", ".join(f"{k} {v * 1e3:.1f}" for v, k in ranked[:top])


def main():
    dev = torch.device("cuda")
    bw = hbm_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["1b", "8b"]
    rows = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8, 64]
    out = []
    for model in models:
        for layer, (n, k) in SHAPES[model].items():
            if model == "8b" and layer == "k/v":
                continue
            mod = make_module(n, k, 16, dev)
            qs = mod.get_base_layer().weight.quant_state
            copies = packed_copies(mod, dev)
            splits = sorted({s for s in (2, 4, 8, 16, 32) if s <= k // 64})
            for m in rows:
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                check_variants(x, mod(x), mod, *copies[0])
                res = {}

                def run(name, fns, res=res):
                    t, _ = graph_ms(fns, dev)
                    res[name] = t["ms"] if t else None

                run("cur", [functools.partial(linear4bit_lora, x, w, lora_a=a, lora_b=b,
                                              scaling=2.0) for w, a, b in copies])
                for name, deq, pf, bn, warps, s in variants(splits):
                    run(name, [functools.partial(k5_call, x, w, a, b, 2.0, bn, s, warps, pf, deq)
                               for w, a, b in copies])
                if m == rows[0]:
                    for s in splits:
                        for warps in (4, 8):
                            run(f"stream bn64 w{warps} s{s}",
                                [functools.partial(stream_call, w, 64, s, warps)
                                 for w, _, _ in copies])
                fl = floor_bytes(m, n, k, 16, qs) / bw * 1e3
                for pre in ("d0", "d1", "d2"):
                    print(f"   {pre} best {best_line(res, pre, 3)}", flush=True)
                print(f"{model} {layer} M={m} floor {fl * 1e3:.1f}us cur {res['cur'] * 1e3:.1f}us"
                      f" | best: {best_line(res, 'd', 4)} | stream best "
                      f"{best_line(res, 'stream', 1)}", flush=True)
                out.append({"model": model, "layer": layer, "N": n, "K": k, "M": m,
                            "floor_ms": fl, "times_ms": res})
                save(bw, out)
            del mod, copies
            bc.free_memory()


if __name__ == "__main__":
    main()

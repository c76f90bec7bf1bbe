"""Bench: the warp-specialized decode linear's consumer work alone, at 1 to 4 CTAs a SM.

Each CTA runs `--steps` steps of the ws kernel's consumer on a 64 x 256 tile: the step's packed
words and x read from shared memory (two copies, alternated so no load leaves the loop), then
the product's code for one lookup (`--modes`): "table", the register tables (`_table`, a new
scale each step, `_lookup_mma`); "pair", the pair table in shared memory (`_chunk_step`, a new
scale each step; one step is first checked against fp64 on the host); "raw", no lookup (the
words' bits as the MMA operand: what the rest of the step costs). No TMA copy, no barrier and
no LoRA term. The grid is k CTAs a SM for k = 1..4 (registers a thread capped so k fit), so
the table says how the SM's rate of weights a clock grows with the consumer warps it holds:
flat from one CTA means a pipe of the SM is saturated by one warp a scheduler; growing means
the warps wait on latency.

    python3 -m bench.lookup_peak                # GPU: the table and the JSON
    python3 -m bench.lookup_peak --sass         # CPU: compile for sm_90, the loop's SASS counts

Writes bench/results/lookup_peak_<GPU>[tag].json: per k, µs a step a CTA, steps a µs a SM,
weights a clock a SM (at the GPU's maximum SM clock), and what an 8B gate projection's 224
tiles x 16 steps would take at that rate.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from trainers.sampling.kernels import _linear4bit_ws_kernel as WK

W_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
X_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))


@gluon.jit
def _raw_mma(words, x0, x1, acc, acc1, acc2, acc3):
    """`_lookup_mma` with no lookup: each word's bits as its four operand registers (the same
    layouts, loads and MMAs; what the step costs without the table and the byte permutes)."""
    w_h0, w_h1 = WK._word_halves(words)
    return WK._halves_mma(_raw_tile(w_h0), _raw_tile(w_h1), x0, x1, acc, acc1, acc2, acc3)


@gluon.jit
def _raw_tile(w):
    """`_a_tile`'s operand with the word itself as each of the four looked-up pairs (register
    moves ptxas drops: no instruction is left in their place)."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        "mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4;", "=r,=r,=r,=r,r", [w],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    return WK._pairs_a(b0, b1, b2, b3)


@gluon.jit
def _lookup_peak_kernel(out_ptr, code_ptr, steps, LOOKUP: gl.constexpr):
    """`steps` consumer steps of one 64 x 256 tile from shared memory; the sums to out_ptr.
    LOOKUP 1: the register tables (`_table`, `_lookup_mma`); 2: the pair table (`_chunk_step`,
    a new scale each step); 0: the words' bits go to the MMAs as they are (`_raw_mma`)."""
    pid = gl.program_id(0)
    if LOOKUP == 2:  # the first allocation, as in the product kernel
        table = gl.allocate_shared_memory(gl.int32, [256, 32], WK.PAIR_TABLE_LAYOUT)
        WK._fill_pair_table(table, code_ptr)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, WK.WORDS2))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, WK.WORDS2))
    words = (r[:, None] * 32 + c[None, :] + pid) * -1640531535  # every nibble value occurs
    wbuf = gl.allocate_shared_memory(gl.int32, [2, 64, 32], W_SMEM)
    wbuf.index(0).store(words)
    wbuf.index(1).store(words ^ 0x5A5A5A5A)
    m = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, WK.XLOAD)))
    e = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, WK.XLOAD)))
    xv = ((m[:, None, None] + e[None, None, :]) % 7).to(gl.float32) * 0.125 - 0.375
    xv = gl.broadcast(xv, gl.full([8, 4, 64], 0.0, gl.float32, WK.XLOAD))[0].to(gl.bfloat16)
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [2, 8, 4, 64], X_SMEM)
    xbuf.index(0).store(xv)
    xbuf.index(1).store(xv)
    rho = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, WK.HALF)))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WK.HALF)))
    scale = (rho[:, None] * 4 + q[None, :]).to(gl.float32) * 1e-4 + 0.01
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = WK._codes(code_ptr)
    acc = gl.zeros([64, 8], gl.float32, WK.MMA)
    acc1 = gl.zeros([64, 8], gl.float32, WK.MMA)
    acc2 = gl.zeros([64, 8], gl.float32, WK.MMA)
    acc3 = gl.zeros([64, 8], gl.float32, WK.MMA)
    if LOOKUP == 2:  # chunk Q's scale (row r of the MMA) 0.5 + r / 1000, times 1 + Q / 4
        rc = gl.arange(0, 64, layout=gl.SliceLayout(1, WK.SCALE_C))
        qc = gl.arange(0, 4, layout=gl.SliceLayout(0, WK.SCALE_C))
        chunk_scale = (rc[:, None] * 0.001 + 0.5) * (1.0 + 0.25 * qc[None, :].to(gl.float32))
        base = WK._pair_table_base(gl.zeros([64, 2, 4], gl.int32, WK.WORDS_Q))
    WK.cta_barrier()
    for i in range(steps):
        if LOOKUP == 2:
            acc, acc1, acc2, acc3 = WK._chunk_step(
                wbuf.index(i % 2).load(WK.WORDS_C), xbuf.index(i % 2).load(WK.XLOAD_C), base,
                chunk_scale, acc, acc1, acc2, acc3)
            chunk_scale = chunk_scale * 1.0000001
        else:
            w = wbuf.index(i % 2).load(WK.WORDS2)
            x0, x1 = WK._x_tiles(xbuf.index(i % 2))
            if LOOKUP == 1:
                tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = WK._table(
                    scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14,
                    c15)
                acc, acc1, acc2, acc3 = WK._lookup_mma(w, tb0, tb1, tb2, tb3, tb4, tb5, tb6,
                                                       tb7, x0, x1, acc, acc1, acc2, acc3)
                scale = scale * 1.0000001  # a new table each step, as each step's own scale
            else:
                acc, acc1, acc2, acc3 = _raw_mma(w, x0, x1, acc, acc1, acc2, acc3)
    out = (acc + acc1) + (acc2 + acc3)
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, WK.MMA))
    mm = gl.arange(0, 8, layout=gl.SliceLayout(0, WK.MMA))
    gl.store(out_ptr + pid * 512 + rr[:, None] * 8 + mm[None, :], out)
    if LOOKUP == 2:  # the table's last use as the compiler sees it (the lookups are PTX)
        table._keep_alive()


def _maxnreg(ctas_per_sm: int) -> int:
    """Registers a thread at which k CTAs of 128 threads fit a SM (65536), a multiple of 8."""
    return min(232, 65536 // (ctas_per_sm * 128) // 8 * 8)


MODES = {"table": 1, "pair": 2, "raw": 0}  # the kernel's LOOKUP by name


def sass_counts(mode: str = "table") -> dict:
    """Compile the kernel for sm_90 on this machine (no GPU) and count its K loop's SASS
    instructions by opcode (the loop: the backward branch whose body holds the HMMAs)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _lookup_peak_kernel
    sig = {"out_ptr": "*fp32", "code_ptr": "*fp32", "steps": "i32", "LOOKUP": "constexpr"}
    src = GluonASTSource(fn, sig, constexprs={(3,): MODES[mode]},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(2)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": _maxnreg(2),
                                     "enable_fp_fusion": False})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    path = "/tmp/lookup_peak.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                          check=True).stdout
    return dict(collections.Counter(_loop_body(sass)).most_common())


def _loop_body(sass: str) -> list[str]:
    """The opcodes of the SASS loop that holds the HMMAs (a backward branch's body)."""
    ins, labels = [], {}
    for line in sass.splitlines():
        if (lab := re.match(r"\s*(\.L_x_\d+):", line)):
            labels[lab.group(1)] = len(ins)
        elif (op := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)):
            ins.append(op.group(1))
    for i, text in enumerate(ins):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), i + 1) <= i:
            body = ins[labels[target.group(1)]:i + 1]
            if any("HMMA" in t for t in body):
                return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body]
    raise RuntimeError("no loop with HMMAs in the SASS")


def _max_sm_clock_ghz() -> float:
    """The GPU's maximum SM clock (nvidia-smi's clocks.max.sm): the rate a clock assumes."""
    query = ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits", "-i",
             "0"]
    out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    return float(out.split()[0]) / 1e3


def _check_pair(code, device) -> bool:
    """One step of the pair mode on one CTA against the same sum in fp64 on the host: the
    words' bf16 code values (high nibble first) times x, chunk Q's sum times its scale."""
    out = torch.zeros(1, 512, device=device, dtype=torch.float32)
    _lookup_peak_kernel[(1,)](out, code, 1, MODES["pair"], num_warps=4, enable_fp_fusion=False)
    rho = torch.arange(64, dtype=torch.int64)
    words = ((rho[:, None] * 32 + torch.arange(32)[None, :]) * -1640531535) & 0xFFFFFFFF
    nib = torch.stack([(words[:, :, None] >> (8 * torch.arange(4)[None, None, :] + sh)) & 15
                       for sh in (4, 0)], dim=-1).reshape(64, 256)  # [row, 8c + 2i + E]
    w = code.cpu().bfloat16().double()[nib]
    e = torch.arange(64)
    x = (((torch.arange(8)[:, None] + e[None, :]) % 7) * 0.125 - 0.375).double()  # (8, 64)
    r = torch.arange(64)
    stage_row = 32 * ((r >> 3) & 1) + 8 * (r >> 4) + (r & 7)  # of MMA row r
    s_row = r.float() * 0.001 + 0.5  # the kernel's fp32 scales
    ref = torch.zeros(64, 8, dtype=torch.float64)
    mag = torch.zeros(64, 8, dtype=torch.float64)  # Σ |s · w · x|
    for q, f in enumerate((1.0, 1.25, 1.5, 1.75)):
        s_q = (s_row * f).double()[:, None]
        ref += s_q * (w[stage_row, 64 * q:64 * q + 64] @ x.T)
        mag += s_q * (w[stage_row, 64 * q:64 * q + 64].abs() @ x.abs().T)
    got = out.view(64, 8).double().cpu()
    err = ((got - ref).abs() / mag).max().item()  # fp32 sums of 256 terms: below 2·256·2⁻²⁴
    print(f"pair step check: max |err| / Σ|s·w·x| {err:.2e} "
          f"({'ok' if err < 2 * 256 * 2.0**-24 else 'WRONG'})")
    return err < 2 * 256 * 2.0**-24


def _time_one(args, mode: str, k: int, sms: int, clock_ghz: float, code, device) -> dict:
    """One row of the table: the kernel at k CTAs a SM with the lookup `mode` (MODES)."""
    grid = k * sms
    out = torch.empty(grid, 512, device=device, dtype=torch.float32)

    def run(steps):
        _lookup_peak_kernel[(grid,)](out, code, steps, MODES[mode], num_warps=4,
                                     maxnreg=_maxnreg(k), enable_fp_fusion=False)

    run(4)
    torch.cuda.synchronize()
    times = {}
    for steps in (args.steps // 4, args.steps):  # two lengths: the launch cost cancels
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(args.reps):
            start.record()
            run(steps)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3)  # µs
        times[steps] = best
    us_step = (times[args.steps] - times[args.steps // 4]) / (args.steps - args.steps // 4)
    per_sm = k / us_step  # steps a µs a SM
    return {"mode": mode, "ctas_per_sm": k, "maxnreg": _maxnreg(k),
            "us_per_step_per_cta": us_step, "steps_per_us_per_sm": per_sm,
            "weights_per_clock_per_sm": per_sm * 64 * 256 / (clock_ghz * 1e3),
            "gate_8b_us_at_this_rate": 224 * 16 / (per_sm * sms)}


def run_gpu(args) -> None:
    from bitsandbytes import functional as bnbF

    from bench import common as bc

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    clock_ghz = _max_sm_clock_ghz()
    code = bnbF.get_4bit_type("nf4", device=device).float()
    pair_ok = _check_pair(code, device) if "pair" in args.modes.split(",") else None
    rows = []
    for mode in args.modes.split(","):
        for k in (1, 2, 3, 4):
            rows.append(_time_one(args, mode, k, sms, clock_ghz, code, device))
            print(rows[-1], flush=True)
    print(f"\n{'mode':>6} {'CTAs/SM':>7} {'µs/step/CTA':>12} {'steps/µs/SM':>12} "
          f"{'weights/clk/SM':>15} {'8B gate µs':>10}")
    for r in rows:
        print(f"{r['mode']:>6} {r['ctas_per_sm']:7d} {r['us_per_step_per_cta']:12.3f} "
              f"{r['steps_per_us_per_sm']:12.3f} {r['weights_per_clock_per_sm']:15.1f} "
              f"{r['gate_8b_us_at_this_rate']:10.1f}")
    env = bc.env_info(device)
    path = Path(args.out_dir) / f"lookup_peak_{bc.short_gpu_name(env['gpu'])}{args.tag}.json"
    bc.write_json(path, {"env": env, "steps": args.steps, "clock_ghz": clock_ghz, "rows": rows,
                         "pair_check_ok": pair_ok,
                         "loop_sass": ({m: sass_counts(m) for m in MODES}
                                       if args.with_sass else None)})
    print("wrote", path)


def main() -> None:
    from bench import common as bc

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="CPU: compile, print the loop's SASS")
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--with-sass", action="store_true", help="also record the loop's SASS")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", str(bc.RESULTS_DIR)))
    ap.add_argument("--tag", default="")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {list(MODES)}")
    args = ap.parse_args()
    if args.sass:
        for mode in MODES:
            counts = sass_counts(mode)
            print(f"loop ({mode}): {sum(counts.values())} "
                  "instructions a step and thread")
            for op, n in counts.items():
                print(f"{n:5d} {op}")
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()

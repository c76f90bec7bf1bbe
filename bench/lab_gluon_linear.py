"""Bench: the warp-specialized decode linear (`trainers.sampling.kernels.linear4bit_ws`) against
the register tile, per layer shape and K split, and its correctness over quantization variants.

The kernel began here as a lab with variants selected by a LAB constexpr (timing cuts without
the lookup, the weight stream, x's or A's copies; one or four accumulators; the LoRA factor
formed by every warp or split over them); bench/README.md, session 29, has what each measured,
and this file at cfb8f74 has that code. What follows times and checks the product kernel.

GPU, from the project root (the bench/README install line first):

    python3 -m bench.lab_gluon_linear --models 8b,1b --rows 8 --splits 1,2,4,8 [--lora]
    python3 -m bench.lab_gluon_linear --check

The first checks each shape against fp64 (the register tile too) within the fp32-sum bound and
times both (graph replays over copies larger than L2, as bench.decode_linear) with the floor;
`--once N,K,split` makes four calls for ncu to attach to. `--check` runs the quantization
variants and odd shapes. Results: bench/results/lab_gluon_linear[_check]_<GPU><tag>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os

import torch
import triton

from trainers.sampling.kernels import linear4bit as L
from trainers.sampling.kernels import linear4bit_ws as WS


def ws_linear(x: torch.Tensor, w: L.Packed4bit, *, lora_a: torch.Tensor | None = None,
              lora_b: torch.Tensor | None = None, scaling: float = 1.0,
              split: int | None = None) -> torch.Tensor:
    """y = x @ round(W)ᵀ + scaling · (x @ lora_aᵀ) @ lora_bᵀ by the warp-specialized kernel at
    `split` K splits (default its split rule); ValueError where it does not run."""
    part = L.LinearPart(w, None, lora_a, lora_b, scaling)
    why = WS.reason(x, [part], False, None)
    if why is not None:
        raise ValueError(f"the warp-specialized kernel does not run here: {why}")
    return WS._launch(x, [part], False, False, split=split)[0]


# the kernel's weights round(code) · scale lie within PAIR_U · u of round(W)'s (u = 2⁻⁸:
# two roundings, the second relative to |round(code · scale)|; the kernel module's docstring)
PAIR_U = (2 + 2.0**-8) / (1 - 2.0**-8)


def check_variants(args) -> None:
    """The kernel against fp64 sums of bitsandbytes' own dequantized weight (within the weights'
    PAIR_U · u and the fp32 sum bound) over NF4 and FP4, with and without double quant, blocksizes 64 and 128, M = 1, 3, 8,
    an N that is not a multiple of 64 and a K of an odd number of steps, one and two splits;
    with a rank-16 LoRA term on the NF4 double-quant cases."""
    from bitsandbytes import functional as bnbF

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    results, worst = [], 0.0
    for qt, nested, bs, (n, k) in itertools.product(("nf4", "fp4"), (True, False), (64, 128),
                                                    ((1024, 2048), (200, 1280))):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        packed, qs = bnbF.quantize_4bit(w, blocksize=bs, compress_statistics=nested,
                                        quant_type=qt)
        pw = L.Packed4bit.from_quant_state(packed, qs)
        wd = bnbF.dequantize_4bit(packed, qs).double()
        loras = [False, True] if qt == "nf4" and nested else [False]
        for m, split, lora in itertools.product((1, 3, 8), (1, 2), loras):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            xd = x.double()
            exact, big_s, kw = xd @ wd.T, xd.abs() @ wd.abs().T, {}
            if lora:
                a = torch.randn(16, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
                b = torch.randn(n, 16, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
                kw = {"lora_a": a, "lora_b": b, "scaling": 2.0}
                exact = exact + 2.0 * (xd @ a.double().T) @ b.double().T
                big_s = big_s + 2.0 * (xd.abs() @ a.double().abs().T) @ b.double().abs().T
            y = ws_linear(x, pw, **kw, split=split)
            bound = (2.0**-8 * exact.abs()
                     + (PAIR_U * 2.0**-8 + 2 * (k + 16 + 64) * 2.0**-24) * big_s)
            ratio = ((y.double() - exact).abs() / bound).max().item()
            worst = max(worst, ratio)
            results.append({"quant": qt, "nested": nested, "blocksize": bs, "N": n, "K": k,
                            "M": m, "split": split, "lora": lora, "err_over_bound": ratio})
    print(f"check: {len(results)} cases, worst error / bound {worst:.3f} "
          f"({'ok' if worst <= 1 else 'FAILED'})")
    out = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", ""),
           "torch": torch.__version__, "triton": triton.__version__, "cases": results,
           "worst_err_over_bound": worst}
    name = os.path.join(os.environ.get("OUT", "bench/results"),
                        f"lab_gluon_linear_check_H100{args.tag}.json")
    with open(name, "w") as f:
        json.dump(out, f, indent=1)
    if worst > 1:
        raise SystemExit(1)


def _exact_and_bound(x, mod, lora: bool):
    """fp64 x @ round(W)ᵀ (+ the LoRA term) of a `bench.decode_linear.make_module` layer, and
    the bound of a sum in fp32 rounded once, the kernel's weights within PAIR_U · u of round(W):
    u·|y| + (PAIR_U · u + 2(K + r + 64)·2⁻²⁴)·S."""
    from bitsandbytes import functional as bnbF

    base = mod.get_base_layer()
    wd = bnbF.dequantize_4bit(base.weight.data, base.weight.quant_state).double()
    xd = x.double()
    exact = xd @ wd.T
    big_s = xd.abs() @ wd.abs().T
    if lora:
        a = mod.lora_A["default"].weight.double()
        b = mod.lora_B["default"].weight.double()
        s = mod.scaling["default"]
        exact = exact + s * (xd @ a.T) @ b.T
        big_s = big_s + abs(s) * (xd.abs() @ a.abs().T) @ b.abs().T
    k = x.shape[1]
    return exact, (2.0**-8 * exact.abs()
                   + (PAIR_U * 2.0**-8 + 2 * (k + 16 + 64) * 2.0**-24) * big_s)


def _lora_args(copy, mod, lora: bool) -> dict:
    """linear4bit_lora's / ws_linear's LoRA keywords for one of `packed_copies`."""
    if not lora:
        return {}
    return {"lora_a": copy[1], "lora_b": copy[2], "scaling": mod.scaling["default"]}


def _variants(spec: str) -> list:
    """[(name suffix, {linear4bit_ws attribute: value})] from "A=1,B=0;A=0" ("" the module's
    own settings)."""
    out = []
    for v in spec.split(";"):
        pairs = [p.split("=") for p in v.split(",") if p]
        out.append(("".join(f" {a}={b}" for a, b in pairs), {a: int(b) for a, b in pairs}))
    return out


@contextlib.contextmanager
def _overridden(overrides: dict):
    """linear4bit_ws's module settings replaced inside the block (the lab's variants)."""
    saved = {a: getattr(WS, a) for a in overrides}
    for a, v in saved.items():
        setattr(WS, a, type(v)(overrides[a]))
    try:
        yield
    finally:
        for a, v in saved.items():
            setattr(WS, a, v)


def run_gpu(args) -> None:
    from bench import common as bc
    from bench import decode_linear as D

    device = torch.device("cuda")
    bw = D.hbm_bandwidth(device)
    sms = L._num_sms(device)
    shapes = {}
    for model in args.models.split(","):
        for name, (n, k) in D.SHAPES[model].items():
            if args.shapes and name not in args.shapes.split(","):
                continue
            shapes[f"{model} {name}"] = (n, k)
    rows = []
    for label, (n, k) in shapes.items():
        mod = D.make_module(n, k, 16, device)
        copies = D.packed_copies(mod, device)
        w0 = copies[0][0]
        kw0 = _lora_args(copies[0], mod, args.lora)
        x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
        reg_tile = L.pick_config(args.rows, n, k, 64, sms)  # an explicit config: not ws
        ref = L.linear4bit_lora(x, w0, **kw0, config=reg_tile)
        exact, tol = _exact_and_bound(x, mod, args.lora)
        lora_bytes = 16 * (n + k) * 2 if args.lora else 0
        floor_ms = (n * k // 2 + n * k // 64 + n * k // 64 // 256 * 4 + args.rows * (n + k) * 2
                    + lora_bytes) / bw * 1e3
        row = {"shape": label, "N": n, "K": k, "M": args.rows, "lora": args.lora,
               "floor_ms": floor_ms,
               "reg_tile_err_over_tol": ((ref.double() - exact).abs() / tol).max().item()}
        t_ref, why = D.graph_ms([lambda c=c, x=x, md=mod, cfg=reg_tile: L.linear4bit_lora(
            x, c[0], **_lora_args(c, md, args.lora), config=cfg) for c in copies], device)
        row["reg_tile_ms"] = t_ref["ms"] if t_ref else why
        row["reg_tile_split"] = reg_tile["SPLIT_K"]
        best = None
        for (vname, overrides), split in itertools.product(_variants(args.variants),
                                                            map(int, args.splits.split(","))):
            if (k // 256) // split < 2 and split > 1:
                continue
            key = f"ws k{split}{vname}"
            with _overridden(overrides):
                try:
                    y = ws_linear(x, w0, **kw0, split=split)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (a split that fails is reported)
                    row[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    continue
                err = ((y.double() - exact).abs() / tol).max().item()
                t, why = D.graph_ms([lambda c=c, x=x, md=mod, s=split: ws_linear(
                    x, c[0], **_lora_args(c, md, args.lora), split=s) for c in copies],
                    device)
            row[key] = {"err_over_tol": err, "ms": t["ms"] if t else why}
            if t and err <= 1 and (best is None or t["ms"] < best[1]):
                best = (key, t["ms"])
        row["ws_rule_split"] = WS.split_rule(n, k, sms)
        row["best"] = best
        rows.append(row)
        print(json.dumps(row), flush=True)
        del mod, copies
        bc.free_memory()
    print(f"\n{'shape':<16} {'floor µs':>9} {'reg tile µs':>12} {'ws best µs':>11}  split")
    for r in rows:
        b = r["best"]
        print(f"{r['shape']:<16} {r['floor_ms'] * 1e3:9.1f} {r['reg_tile_ms'] * 1e3:12.1f} "
              f"{(b[1] * 1e3 if b else float('nan')):11.1f}  {b[0] if b else '-'}")
    out = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", ""),
           "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    name = os.path.join(os.environ.get("OUT", "bench/results"),
                        f"lab_gluon_linear_H100{args.tag}.json")
    with open(name, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", name)


def once(n: int, k: int, split: int, rows: int) -> None:
    """Four calls of the kernel on one shape (NF4, double quant, rank-16 LoRA), for ncu."""
    from bench import decode_linear as D

    device = torch.device("cuda")
    mod = D.make_module(n, k, 16, device)
    w, a, b = D.packed_part(mod)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    for _ in range(4):
        ws_linear(x, w, lora_a=a, lora_b=b, scaling=mod.scaling["default"], split=split)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="quantization variants, odd shapes")
    ap.add_argument("--once", default="",
                    help="N,K,split: four calls (of the first --variants variant), for ncu")
    ap.add_argument("--models", default="8b,1b")
    ap.add_argument("--shapes", default="", help="only these shape names, e.g. gate/up,down")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--lora", action="store_true", help="with the LoRA term (rank 16)")
    ap.add_argument("--variants", default="",
                    help="';'-separated sets of linear4bit_ws settings, e.g. ';STAGES=3' "
                         "(the module's own, then STAGES=3: an A/B)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.once:
        n, k, split = (int(v) for v in args.once.split(","))
        with _overridden(_variants(args.variants)[0][1]):  # the first variant's settings
            once(n, k, split, args.rows)
    elif args.check:
        for vname, overrides in _variants(args.variants):
            with _overridden(overrides):
                check_variants(argparse.Namespace(**{
                    **vars(args), "tag": args.tag + vname.replace(" ", "_").replace("=", "")}))
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()

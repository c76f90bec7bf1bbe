"""Sweep the row-bounded GEMMs 2 and 3 (kernels/gemm_rows.py) on a GPU against cuBLAS.

    python -m bench.tune_gemm_rows [--shapes llama-1b,qwen-0.5b,llama-8b] [--ops basis,grad_w]
        [--json out.json]

Per shape (one chunk of the fused loop, its rows from grpo_lce's default chunk sizing for a
frozen head, or --basis-rows):
  basis  factor ∘ (G' W) − α ∘ W[y] (M, H): cuBLAS mm (fp32 out) + two elementwise passes,
         which is what a host-sized chunk costs, against the Triton split-K kernel + finish pass
         for each configuration and split-K wave target;
  dW     dW += G'ᵀ (factor ∘ X) over a 4096-row chunk: cuBLAS addmm (fp32 out) against the
         Triton kernel;
each also with only half the chunk's rows valid (the Triton kernels read that count on the
device; cuBLAS is then given the half-size operands, as a host-synchronised loop would).
Every configuration is checked against the cuBLAS result. The chosen configurations go into
grpo_lce/kernels/_tuning.py by hand.
"""

import argparse
import json

import torch
import triton.testing

from bench.head import SHAPES
from grpo_lce._chunks import MIN_ROWS_GRAD_WEIGHT_FUSED, fused_chunk_size
from grpo_lce.kernels import gemm_rows as gr
from grpo_lce.kernels import gemm_softmax as gs

BASIS_CFGS = [
    dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4),
    dict(BM=128, BN=128, BK=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
    dict(BM=64, BN=256, BK=64, num_warps=4, num_stages=4),
    dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=3),
    dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3),
    dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=4),
]
GRAD_W_CFGS = [
    dict(BV=128, BN=256, BK=64, num_warps=8, num_stages=4),
    dict(BV=128, BN=256, BK=64, num_warps=8, num_stages=3),
    dict(BV=256, BN=128, BK=64, num_warps=8, num_stages=3),
    dict(BV=256, BN=128, BK=64, num_warps=8, num_stages=4),
    dict(BV=128, BN=128, BK=64, num_warps=8, num_stages=4),
]
GRAD_W_ORDER = [dict(GROUP_V=1, FLATTEN=True), dict(GROUP_V=8, FLATTEN=True),
                dict(GROUP_V=32, FLATTEN=True), dict(GROUP_V=8, FLATTEN=False)]


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def _g_buffer(M, V, dev):
    g = torch.empty(M, gs.g_row_stride(V), device=dev, dtype=torch.bfloat16)[:, :V]
    g.copy_(torch.rand(M, V, device=dev) * 2.0)
    return g


def sweep_shape(name, N, H, V, ops=("basis", "grad_w"), basis_rows=None, dev="cuda"):
    torch.manual_seed(0)
    C = basis_rows or fused_chunk_size(V, gs.n_parts(V, True), 2, True, n_rows=N)
    w = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * H**-0.5
    rows = []
    # --- basis (GEMM 2) over one chunk of C rows ---
    g = _g_buffer(C, V, dev)
    factor = torch.rand(C, device=dev)
    alpha = torch.rand(C, device=dev)
    y = torch.randint(0, V, (C,), device=dev)
    out = torch.empty(C, H, device=dev)
    for frac in (1.0, 0.5) if "basis" in ops else ():
        m = int(C * frac)
        n_valid = torch.tensor([m], device=dev, dtype=torch.int32)

        def cublas(m=m):
            b = torch.mm(g[:m], w, out_dtype=torch.float32)
            b.mul_(factor[:m, None]).addcmul_(w.index_select(0, y[:m]), alpha[:m, None],
                                              value=-1.0)
            return b

        ref = cublas()
        t_ref = _bench(cublas)
        rows.append(dict(shape=name, op="basis", rows=C, valid=m, impl="cublas", ms=t_ref))
        print(f"{name} basis C={C} valid={m}: cuBLAS {t_ref:.3f} ms")
        for c in BASIS_CFGS:
            rule = gr.n_splits(C, H, V, g.device, c)
            for S in sorted({1, 2, 4, rule, max(1, rule - 1), rule + 1, 2 * rule}):
                try:
                    def run(c=c, S=S, n_valid=n_valid, out=out):
                        return gr.basis_gemm(g, w, factor, alpha, y, n_valid, 0, out,
                                             cfg=c, split=S)
                    run()
                    err = (out[:m] - ref).abs().max().item() / ref.abs().max().item()
                    zero_ok = bool((out[m:] == 0).all())
                    t = _bench(run)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {c} split={S}: failed {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append(dict(shape=name, op="basis", rows=C, valid=m, impl="triton",
                                 cfg=c, split=S, rule=S == rule, ms=t, rel_err=err,
                                 zero_rows_ok=zero_ok))
                tag = " (rule)" if S == rule else ""
                print(f"  {c} split={S}{tag}: {t:.3f} ms ({t / t_ref:.2f}x) err {err:.1e} "
                      f"zeros {'ok' if zero_ok else 'WRONG'}")
    del g, out
    if "grad_w" not in ops:
        return rows
    # --- dW (GEMM 3) over one chunk of MIN_ROWS_GRAD_WEIGHT_FUSED rows ---
    Cw = min(MIN_ROWS_GRAD_WEIGHT_FUSED, N)
    g = _g_buffer(Cw, V, dev)
    xf = torch.randn(Cw, H, device=dev, dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device=dev)
    for frac in (1.0, 0.5):
        m = int(Cw * frac)
        n_valid = torch.tensor([m], device=dev, dtype=torch.int32)
        xf_m = xf.clone()
        xf_m[m:] = 0
        gm = _g_buffer(Cw, V, dev)
        gm.copy_(g)
        gm[m:] = 0

        def cublas_dw(m=m):
            torch.addmm(dw, gm[:m].t(), xf_m[:m], out_dtype=torch.float32, out=dw)

        dw.zero_()
        cublas_dw()
        ref = dw.clone()
        t_ref = _bench(cublas_dw)
        rows.append(dict(shape=name, op="grad_w", rows=Cw, valid=m, impl="cublas", ms=t_ref))
        print(f"{name} dW chunk={Cw} valid={m}: cuBLAS addmm {t_ref:.3f} ms")
        for cfg in [dict(c, **o) for c in GRAD_W_CFGS for o in GRAD_W_ORDER]:
            try:
                def run(cfg=cfg, n_valid=n_valid):
                    gr.grad_w_gemm(dw, gm, xf_m, n_valid, 0, first=False, cfg=cfg)
                dw.zero_()
                run()
                err = (dw - ref).abs().max().item() / ref.abs().max().item()
                t = _bench(run)
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append(dict(shape=name, op="grad_w", rows=Cw, valid=m, impl="triton",
                             cfg=cfg, ms=t, rel_err=err))
            print(f"  {cfg}: {t:.3f} ms ({t / t_ref:.2f}x) err {err:.1e}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-1b,qwen-0.5b,llama-8b")
    ap.add_argument("--ops", default="basis,grad_w", help="comma list of basis,grad_w")
    ap.add_argument("--basis-rows", type=int, default=None,
                    help="rows of the basis chunk (default: the fused loop's chunk of a frozen "
                         f"head; a trainable head's is {MIN_ROWS_GRAD_WEIGHT_FUSED})")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    rows = []
    for name in args.shapes.split(","):
        rows += sweep_shape(name, *SHAPES[name], ops=args.ops.split(","),
                            basis_rows=args.basis_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

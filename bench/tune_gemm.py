"""Sweep the fused GEMM 1 (kernels/gemm_softmax.py) configurations on a GPU against cuBLAS.

    python -m bench.tune_gemm [--h 2048] [--v 128256] [--n 8192] [--chunk 1024]

For each configuration: the statistics-only launch over all N rows (log-probs without gradient)
and the statistics + G' launch over chunks of `--chunk` rows (the gradient paths), each against
one cuBLAS GEMM X @ Wᵀ with bf16 output over the same rows (the floor). Also checks the
statistics against fp32 cuBLAS logits + torch on the first chunk. The chosen configuration goes
into grpo_lce/kernels/_tuning.py by hand.
"""

import argparse
import itertools
import json

import torch
import triton.testing

from grpo_lce.kernels import _tuning
from grpo_lce.kernels import gemm_softmax as gs
from grpo_lce.kernels.target_logit import target_logits


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60)


_DEFAULT_GRAD = dict(_tuning.GEMM_GRAD)
_DEFAULT_REDUCE = dict(_tuning.REDUCE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    ap.add_argument("--reduce", action="store_true",
                    help="also sweep the reduction's configurations (one chunk, with G')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    N, H, V, C = args.n, args.h, args.v, args.chunk
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * H**-0.5
    y = torch.randint(0, V, (N,), device=dev)
    T_max = -(-V // 64) * 2
    parts = {k: torch.empty(T_max * N, device=dev) for k in "msdv"}
    parts["a"] = torch.empty(T_max * N, device=dev, dtype=torch.int32)
    g = torch.empty(C, gs.g_row_stride(V), device=dev, dtype=torch.bfloat16)[:, :V]
    zy2 = target_logits(x, w, y, None, gs.LOG2E)

    floor_all = _bench(lambda: x @ w.t())
    floor_f32 = _bench(lambda: torch.mm(x, w.t(), out_dtype=torch.float32))
    floor_chunks = _bench(lambda: [x[s:s + C] @ w.t() for s in range(0, N, C)])
    gemm2 = _bench(lambda: [torch.mm(g, w, out_dtype=torch.float32) for s in range(0, N, C)])
    t_target = _bench(lambda: target_logits(x, w, y, None, gs.LOG2E))
    name = torch.cuda.get_device_name()
    print(f"{name}  N={N} H={H} V={V} chunk={C}")
    print(f"cuBLAS X@Wt bf16 out {floor_all:.3f} ms ({2 * N * H * V / floor_all / 1e9:.0f} "
          f"TFLOP/s); fp32 out {floor_f32:.3f}; bf16 in chunks {floor_chunks:.3f}; "
          f"GEMM2 G'@W over chunks {gemm2:.3f}; target logits {t_target * 1e3:.1f} us")

    # reference statistics of the first chunk
    zr = torch.mm(x[:C], w.t(), out_dtype=torch.float32)
    lse_r = torch.logsumexp(zr, 1)
    zy_r = zr.gather(1, y[:C, None]).squeeze(1)
    p_r = torch.softmax(zr, 1)
    ent_r = -(p_r * torch.log(p_r.clamp_min(1e-45))).sum(1)
    am_r = zr.argmax(1)
    del zr

    # (BN = 256 with one epilogue part at 4 stages, or BK = 128, needs more shared memory than
    # an H100/H200 has)
    base = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)
    grid = [
        dict(base, EPI_SPLIT=1),
        dict(base, EPI_SPLIT=2),
        dict(base, num_stages=4, EPI_SPLIT=2),
        dict(base, BK=128, num_stages=2, EPI_SPLIT=2),
        dict(base, BM=256, BN=128, EPI_SPLIT=1),
    ]
    groups = (8, 32)
    if args.quick:
        grid, groups = grid[:2], (8,)
    rows = []
    for point, group_m in itertools.product(grid, groups):
        cfg = dict(point, FLATTEN=True, GROUP_M=group_m)
        _tuning.GEMM_STATS = _tuning.GEMM_GRAD = cfg
        T = gs.n_parts(V, True)
        lse = torch.empty(N, device=dev)
        zy = torch.empty(N, device=dev)
        ent = torch.empty(N, device=dev)
        am = torch.empty(N, device=dev, dtype=torch.int64)
        fac = torch.empty(N, device=dev)
        flag_rows = torch.empty(N, device=dev, dtype=torch.int32)
        n_flag = torch.zeros(1, device=dev, dtype=torch.int32)

        def stats_only():
            gs.gemm_softmax(x, w, None, 1.0, parts, want_d=True)
            gs.reduce_partials(parts, N, T, (lse, zy, ent, None), zy2)

        def with_g():
            for s in range(0, N, C):
                e = min(s + C, N)
                gs.gemm_softmax(x[s:e], w, None, 1.0, parts, zy2=zy2[s:e], g_out=g[: e - s])
                gs.reduce_partials(parts, e - s, T, (lse[s:e], zy[s:e], None, None), zy2[s:e],
                                   factor=fac[s:e], flag_rows=flag_rows,
                                   n_flag=n_flag)

        try:
            gs.gemm_softmax(x[:C], w, None, 1.0, parts, zy2=zy2[:C], g_out=g,
                            want_d=True, want_argmax=True)
            gs.reduce_partials(parts, C, T, (lse[:C], zy[:C], ent[:C], am[:C]), zy2[:C],
                               factor=fac[:C], flag_rows=flag_rows, n_flag=n_flag)
            torch.cuda.synchronize()
            err = dict(
                lse=(lse[:C] - lse_r).abs().max().item(),
                zy=(zy[:C] - zy_r).abs().max().item(),
                ent=(ent[:C] - ent_r).abs().max().item(),
                amax=(am[:C] != am_r).sum().item(),
                p_rel=((g.float() * fac[:C, None] - p_r).abs().max() / p_r.max()).item(),
                flags=int(n_flag.item()),
            )
            t_stats = _bench(stats_only)
            t_g = _bench(with_g)
        except Exception as exc:  # a configuration the compiler refuses: report and go on
            print(f"{cfg}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        row = dict(cfg=cfg, stats_ms=t_stats, stats_x=t_stats / floor_all, g_ms=t_g,
                   g_x=t_g / floor_chunks, err=err)
        rows.append(row)
        print(f"{cfg}\n   stats {t_stats:.3f} ms ({row['stats_x']:.3f}x floor)  "
              f"stats+G' {t_g:.3f} ms ({row['g_x']:.3f}x chunked floor)  err {err}", flush=True)
    reduce_rows = _sweep_reduce(x, w, zy2, g, parts, C) if args.reduce else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=name, N=N, H=H, V=V, chunk=C, floor=floor_all,
                           floor_f32=floor_f32, floor_chunks=floor_chunks, gemm2=gemm2,
                           target_logits=t_target,
                           rows=rows, reduce=reduce_rows), f, indent=1)


REDUCE_CFGS = [dict(BR=32, BT=64, num_warps=4), dict(BR=16, BT=64, num_warps=4),
               dict(BR=16, BT=128, num_warps=4), dict(BR=8, BT=128, num_warps=4),
               dict(BR=16, BT=256, num_warps=8), dict(BR=8, BT=256, num_warps=4),
               dict(BR=32, BT=128, num_warps=8), dict(BR=8, BT=512, num_warps=8),
               dict(BR=4, BT=256, num_warps=4)]


def _sweep_reduce(x, w, zy2, g, parts, C):
    """Time the reduction of one chunk's partials after a launch with G', per configuration:
    bare (log-probs with a gradient) and with entropy and argmax (the SFT metrics); compare
    each with the first configuration (sums in another order: fp32 rounding only)."""
    dev = x.device
    V = w.shape[0]
    _tuning.GEMM_GRAD = dict(_DEFAULT_GRAD)
    T = gs.n_parts(V, True)
    rows = []
    for metrics in (False, True):
        gs.gemm_softmax(x[:C], w, None, 1.0, parts, zy2=zy2[:C], g_out=g,
                        want_d=metrics, want_argmax=metrics)
        ref = None
        for cfg in REDUCE_CFGS:
            _tuning.REDUCE = cfg
            out = (torch.empty(C, device=dev), torch.empty(C, device=dev),
                   torch.empty(C, device=dev) if metrics else None,
                   torch.empty(C, device=dev, dtype=torch.int64) if metrics else None)
            fac = torch.empty(C, device=dev)
            flag_rows = torch.empty(C, device=dev, dtype=torch.int32)
            n_flag = torch.zeros(1, device=dev, dtype=torch.int32)

            def run():
                gs.reduce_partials(parts, C, T, out, zy2[:C], factor=fac,
                                   flag_rows=flag_rows, n_flag=n_flag)

            run()
            got = torch.stack([o.float() for o in out if o is not None] + [fac])
            ref = got if ref is None else ref
            ms = _bench(run)
            diff = ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
            rows.append(dict(cfg=cfg, metrics=metrics, ms=ms, max_rel_diff_to_first=diff))
            print(f"reduce metrics={metrics} {cfg}: {ms * 1e3:.1f} us  max rel diff to the "
                  f"first: {diff:.1e}", flush=True)
    _tuning.REDUCE = dict(_DEFAULT_REDUCE)
    return rows


if __name__ == "__main__":
    main()

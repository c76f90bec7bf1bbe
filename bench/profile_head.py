"""Per-kernel GPU time of one grpo_lce call (torch.profiler), to see where a case's time goes.

    python -m bench.profile_head [--case i|ii|iii|iv] [--n 8192 --h 2048 --v 128256]
        [--chunk-size C]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from grpo_lce import linear_cross_entropy, linear_logprobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="i", choices=["i", "ii", "iii", "iv"])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--rows", type=int, default=25, help="kernels / functions listed")
    ap.add_argument("--host", action="store_true",
                    help="also the host side: issue time per call and a cProfile of 20 calls")
    ap.add_argument("--sort", default="tottime", help="cProfile order (tottime, cumulative)")
    args = ap.parse_args()
    torch.manual_seed(0)
    h = torch.randn(args.n, args.h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.v, args.h, device="cuda", dtype=torch.bfloat16) * args.h**-0.5
    y = torch.randint(0, args.v, (args.n,), device="cuda")
    g = torch.randn(args.n, device="cuda")
    cs = args.chunk_size

    def run():
        if args.case == "ii":
            with torch.no_grad():
                linear_logprobs(h, w, y, return_entropy=True, chunk_size=cs)
            return
        hg = h.detach().requires_grad_()
        wg = w.detach().requires_grad_(args.case == "iii")
        if args.case == "i":
            (linear_logprobs(hg, wg, y, chunk_size=cs) * g).sum().backward()
        else:
            linear_cross_entropy(hg, wg, y, chunk_size=cs).backward()

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"case {args.case} N={args.n} H={args.h} V={args.v} chunk={cs}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=70))
    if args.host:
        _host(run, args.rows, args.sort)
        _gaps(run)


def _gaps(run, calls=5, min_gap_us=30.0):
    """GPU idle gaps over `calls` back-to-back calls: busy kernel time against the span, and
    the kernels each long gap follows (a host sync or slow host code shows up here)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    print(f"{calls} calls: GPU busy {busy / 1e3 / calls:.3f} ms/call of a span "
          f"{span / 1e3 / calls:.3f} ms/call")
    for a, b in zip(kernels, kernels[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > min_gap_us:
            print(f"  gap {gap:8.1f} us after {a.name[:60]} before {b.name[:60]}")


def _host(run, rows, sort="tottime"):
    """Wall time per call (events) against the time the host takes to issue it."""
    import cProfile
    import pstats
    import statistics
    import time

    wall, issue = [], []
    for _ in range(20):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        run()
        issue.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        wall.append(start.elapsed_time(end))
    print(f"per call: wall {statistics.median(wall):.3f} ms, host issue "
          f"{statistics.median(issue):.3f} ms (medians of 20)")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats(sort).print_stats(rows)


if __name__ == "__main__":
    main()

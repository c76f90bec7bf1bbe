"""Where one decode step's GPU time goes: `trainers.sampling.DecodeLoop` on the 1B or 8B NF4 +
LoRA shape (bench.decode_loop's model and prompts), per kernel and launch grid.

The torch profiler records every kernel, those replayed inside the loop's CUDA graphs included,
over two steady calls that sample --new and --short tokens from the same prompts. The prefill
and the per-call work are the same in both, so each kernel's time in the longer call minus its
time in the shorter, divided by the difference in tokens, is its time per sampled token: one
decode step, plus its share of any step the graphs run past the last token (a kernel once a
step then shows slightly more than one launch a token). A kernel of the prefill alone nets to
about zero and is left out of the table. The decode linear's launches share one kernel name;
the grid tells them apart: (1, tiles, splits), q/k/v and gate/up being one launch each.

    python -m bench.profile_decode_step                      # 1B, batch 8
    python -m bench.profile_decode_step --model 8b --batch 8

Writes bench/results/profile_decode_step_<GPU>_<model>_b<batch>[tag].json and prints the table:
µs per token, launches per token, µs per launch.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch

from bench import common as bc
from bench import decode_loop as D


def kernel_times(fn, events_out: list | None = None) -> dict:
    """{(kernel name, grid): [launches, µs]} of the CUDA kernels `fn` runs (profiler trace);
    `events_out` gets each kernel's (name, grid, start µs, duration µs) in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "kernel":
            key = (e["name"], str(e.get("args", {}).get("grid")))
            out[key][0] += 1
            out[key][1] += e["dur"]
            if events_out is not None:
                events_out.append((e["name"], key[1], float(e["ts"]), float(e["dur"])))
    if events_out is not None:
        events_out.sort(key=lambda ev: ev[2])
    return out


def timeline(events: list, count: int) -> list[dict]:
    """`count` consecutive kernels from the middle of `events` (a decode step's stretch): each
    one's start and end relative to the first's start, and its start minus the end of the one
    before (negative: it launched early, PDL, and waited beside it)."""
    mid = len(events) // 2
    window = events[mid:mid + count]
    t0 = window[0][2]
    rows = []
    for i, (name, grid, ts, dur) in enumerate(window):
        prev_end = window[i - 1][2] + window[i - 1][3] if i else ts
        rows.append({"kernel": name, "grid": grid, "start_us": ts - t0,
                     "end_us": ts + dur - t0, "dur_us": dur, "after_prev_end_us": ts - prev_end})
    return rows


def per_step(long: dict, short: dict, tokens: int) -> list[dict]:
    """Each kernel's launches and µs per token from two calls `tokens` tokens apart, largest
    first; kernels under 0.05 µs a token (the prefill's) are left out."""
    rows = []
    for key in set(long) | set(short):
        n = (long.get(key, [0, 0.0])[0] - short.get(key, [0, 0.0])[0]) / tokens
        us = (long.get(key, [0, 0.0])[1] - short.get(key, [0, 0.0])[1]) / tokens
        if us >= 0.05:
            rows.append({"kernel": key[0], "grid": key[1], "launches_per_step": n,
                         "us_per_step": us, "us_per_launch": us / n if n > 0 else None})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("1b", "8b"), default="1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=64, help="tokens of the longer call")
    p.add_argument("--short", type=int, default=16, help="tokens of the shorter call")
    p.add_argument("--model-cache", default="/tmp/grpo_lce_e2e_models")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--tag", default="")
    p.add_argument("--timeline", type=int, default=0,
                   help="also print and record this many consecutive kernels of the longer "
                        "call's middle: start, end, duration and the lead over the one before")
    p.add_argument("--variant", default="loop", choices=[v for v in D.VARIANTS if
                                                         v.startswith("loop")],
                   help="bench.decode_loop's loop variant to profile")
    a = p.parse_args(argv)
    if a.new <= a.short:
        p.error("--new must be larger than --short")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda")
    model = D.load_policy(a.model, "nf4", a.model_cache, "cuda")
    V = model.config.vocab_size
    ids, mask = D.prompts(a.batch, V, "cuda")
    loop = D.Variant(a.variant, model, "cuda", check_every=16)
    calls = {n: D.generation_config(n, V) for n in (a.new, a.short)}
    for n in (a.new, a.short):  # compile, capture and warm both lengths
        loop(ids, mask, calls[n])
    torch.cuda.synchronize()
    events: list = []
    long = kernel_times(lambda: loop(ids, mask, calls[a.new]), events)
    short = kernel_times(lambda: loop(ids, mask, calls[a.short]))
    rows = per_step(long, short, a.new - a.short)
    total = sum(r["us_per_step"] for r in rows)
    print(f"{a.model} NF4 + LoRA, batch {a.batch}, {a.variant}: kernels {total:.1f} µs per token "
          f"({a.new} - {a.short} tokens)")
    print(f"{'µs/token':>8} {'launches':>8} {'µs/launch':>9}  kernel  grid")
    for r in rows:
        per = f"{r['us_per_launch']:9.2f}" if r["us_per_launch"] else f"{'':9}"
        print(f"{r['us_per_step']:8.1f} {r['launches_per_step']:8.2f} {per}  "
              f"{r['kernel'][:60]}  {r['grid']}")
    line = timeline(events, a.timeline) if a.timeline else []
    if line:
        print(f"{'start':>8} {'end':>8} {'dur':>6} {'lead':>6}  kernel  grid")
    for r in line:
        print(f"{r['start_us']:8.1f} {r['end_us']:8.1f} {r['dur_us']:6.1f} "
              f"{r['after_prev_end_us']:6.1f}  {r['kernel'][:50]}  {r['grid']}")
    env = bc.env_info(device)
    out = Path(a.out_dir) / (f"profile_decode_step_{bc.short_gpu_name(env['gpu'])}_{a.model}"
                             f"_b{a.batch}{a.tag}.json")
    bc.write_json(out, {"env": env, "model": a.model, "batch": a.batch, "new": a.new,
                        "short": a.short, "variant": a.variant, "kernel_path": loop.sampler.kernels,
                        "us_per_step_total": total, "kernels": rows,
                        "timeline": line})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""linear_sample against torch and against the floor: reading the head weight once from HBM.

h (B, H) bf16, W (V, H) bf16 (std 0.02, h scaled so the logits have std 2), V = 128256:

    ours             grpo_lce.linear_sample, temperature 1 (one pass over W)
    ours min-p       min_p = 0.05 (two passes: the row max, then the draw)
    ours greedy      temperature 0
    ours (graph)     the temperature-1 call captured in a CUDA graph and replayed (no launch or
                     Python overhead: what a captured decode step sees)
    torch            logits = (h @ Wᵀ).float() / τ, softmax, torch.multinomial, log_softmax gather
    torch greedy     (h @ Wᵀ).float().argmax
    head_logits (graph)   the decode loop's LM head, (B, V) fp32 logits of bf16 values
                     (trainers.sampling.kernels.head_logits), captured in a CUDA graph
    cuBLAS logits (graph) the same logits as the module computes them, (h @ Wᵀ).float(), captured
    floor            V·H·2 bytes ÷ the HBM bandwidth, measured in the same run by a 4 GiB
                     device-to-device copy (read + write: 2 × bytes ÷ time)

Before timing, each shape's log-probs are checked against fp64 (the run aborts past 1e-3; the
test suite holds the rounding bound) and the graph's replays must draw fresh tokens.
Median ms with the 20-80 % spread (bench.common.time_ms: triton.testing.do_bench, L2 flushed).
`--sweep` also times launch configurations of the kernel at each shape (tokens must equal the
default configuration's: the noise is keyed by (row, vocab index), not by the tiling).

GPU (from the project root):

    python -m bench.sample                      # B = 8, 64 × H = 2048, 4096; ~1 min on an H100
    python -m bench.sample --sweep --batches 8 --hidden 2048   # launch configurations, ~2 min
    python -m bench.sample --device cpu --quick # CPU smoke run (torch path, no CUDA timers)

Writes bench/results/sample_<GPU>[_quick][--tag].{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from bench import common as bc
from grpo_lce import linear_sample
from grpo_lce.kernels import sample_rows
from grpo_lce.reference import sample_logprobs_ref
from trainers.sampling.kernels.head_logits import head_logits

V_DEFAULT = 128256  # Llama-3 vocabulary


def hbm_bandwidth(device) -> float | None:
    """Bytes/s of a 4 GiB device copy (read + write counted), median of do_bench."""
    if device.type != "cuda":
        return None
    n = 2**31  # bf16 elements: 4 GiB
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    t = bc.time_ms(lambda: b.copy_(a), device)["ms"]
    del a, b
    bc.free_memory()
    return 2 * n * 2 / (t * 1e-3)


def inputs(B, H, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(V, H, generator=g, device=device) * 0.02).bfloat16()
    h = (torch.randn(B, H, generator=g, device=device) * 2.0 / (0.02 * H**0.5)).bfloat16()
    return h, w


def torch_sample(h, w, gen):
    z = (h @ w.t()).float()  # (B, V) bf16 logits, then fp32
    tok = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)
    return tok.squeeze(1), torch.log_softmax(z, -1).gather(1, tok).squeeze(1)


def check(h, w, gen) -> float:
    tok, logp = linear_sample(h, w, generator=gen)
    ref = sample_logprobs_ref(h, w).gather(1, tok[:, None]).squeeze(1)
    err = float((logp.double() - ref).abs().max())
    if not err <= 1e-3:
        sys.exit(f"linear_sample log-probs off by {err:.2e} from fp64 at shape {tuple(h.shape)}")
    return err


def graph_call(h, w, device):
    """A replay of linear_sample captured in a CUDA graph, and whether replays draw afresh."""
    for _ in range(2):
        linear_sample(h, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok, _ = linear_sample(h, w)
    graph.replay()
    first = tok.clone()
    graph.replay()
    torch.cuda.synchronize(device)
    return graph.replay, not torch.equal(first, tok)


def graph_replay(fn):
    """fn captured in a CUDA graph (after two warm-up calls): its replay."""
    for _ in range(2):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sweep(h, w, device):
    """(config, ms) of launch configurations of the temperature-1 kernel + combine; BLOCK_B
    from 16 to the batch's power of two."""
    seed = torch.tensor([12345], device=device)
    ref_tok = sample_rows.combine(sample_rows.sample_tiles(h, w, None, 1.0, seed=seed))[0]
    rows = []
    bbs = [b for b in (16, 64) if b <= max(16, h.shape[0])]
    for bb, bv, bh, warps, stages, tiles in itertools.product(
            bbs, (64, 128, 256), (64, 128), (4, 8), (3, 4), (1, 2)):
        cfg = dict(BLOCK_V=bv, BLOCK_B=bb, BLOCK_H=bh, TILES=tiles, num_warps=warps,
                   num_stages=stages)

        def fn(cfg=cfg):
            return sample_rows.combine(
                sample_rows.sample_tiles(h, w, None, 1.0, seed=seed, config=cfg))
        try:
            same = torch.equal(fn()[0], ref_tok)
            t = bc.time_ms(fn, device)
        except Exception as e:  # noqa: BLE001 (shared memory overflow and the like: n/a)
            rows.append({"config": cfg, "status": bc.short_error(e)})
            continue
        rows.append({"config": cfg, "status": "ok", "same_tokens": same, **t})
        print(f"  {cfg}  {t['ms']:.4f} ms  same tokens: {same}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="8,64", help="comma list of B")
    p.add_argument("--hidden", default="2048,4096", help="comma list of H")
    p.add_argument("--vocab", type=int, default=V_DEFAULT)
    p.add_argument("--sweep", action="store_true", help="time launch configurations")
    p.add_argument("--quick", action="store_true", help="B = 8, H = 256, V = 8000")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if a.quick:
        a.batches, a.hidden, a.vocab = "8", "256", 8000
    env = bc.env_info(device)
    bw = hbm_bandwidth(device)
    res = {"env": env, "args": vars(a), "hbm_bytes_per_s": bw, "rows": [], "sweep": []}
    print(f"{env.get('gpu') or 'cpu'}  torch {env['torch']}  triton {env.get('triton')}  "
          f"commit {env['commit']}  HBM copy {bw / 1e9 if bw else float('nan'):.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    lines = ["| B | H | variant | ms (p20-p80) | × floor |", "|---|---|---|---|---|"]
    for B, H in itertools.product(map(int, a.batches.split(",")), map(int, a.hidden.split(","))):
        h, w = inputs(B, H, a.vocab, device)
        err = check(h, w, gen)
        floor_ms = w.numel() * w.element_size() / bw * 1e3 if bw else None
        variants = {
            "ours": lambda: linear_sample(h, w, generator=gen),
            "ours min-p": lambda: linear_sample(h, w, generator=gen, min_p=0.05),
            "ours greedy": lambda: linear_sample(h, w, temperature=0.0),
            "torch": lambda: torch_sample(h, w, gen),
            "torch greedy": lambda: (h @ w.t()).float().argmax(-1),
        }
        fresh = None
        if device.type == "cuda":
            variants["ours (graph)"], fresh = graph_call(h, w, device)
            head = torch.nn.Linear(H, a.vocab, bias=False, device="meta")
            head.weight = torch.nn.Parameter(w, requires_grad=False)
            variants["head_logits (graph)"] = graph_replay(lambda: head_logits(h, head))
            variants["cuBLAS logits (graph)"] = graph_replay(lambda: (h @ w.t()).float())
        for name, fn in variants.items():
            t = bc.time_ms(fn, device)
            ratio = t["ms"] / floor_ms if floor_ms else None
            res["rows"].append({"B": B, "H": H, "V": a.vocab, "variant": name, **t,
                                "floor_ms": floor_ms, "x_floor": ratio, "logp_err": err,
                                "graph_fresh_draws": fresh})
            lines.append(f"| {B} | {H} | {name} | {t['ms']:.4f} ({t['p20']:.4f}-{t['p80']:.4f})"
                         f" | {f'{ratio:.2f}' if ratio else 'n/a'} |")
            print(lines[-1], flush=True)
        if floor_ms:
            lines.append(f"| {B} | {H} | floor (W once) | {floor_ms:.4f} | 1.00 |")
            print(lines[-1])
        print(f"  logp max |err| vs fp64 {err:.2e}; graph replays draw afresh: {fresh}")
        if a.sweep and device.type == "cuda":
            res["sweep"] += [{"B": B, "H": H, **r} for r in sweep(h, w, device)]
        del h, w
        bc.free_memory()
    tag = bc.gpu_short_name(device) + ("_quick" if a.quick else "") + a.tag
    out = Path(a.out_dir)
    bc.write_json(out / f"sample_{tag}.json", res)
    head = (f"linear_sample, V = {a.vocab}, bf16; {env.get('gpu') or 'cpu'}, torch "
            f"{env['torch']}, triton {env.get('triton')}, commit {env['commit']}; HBM copy "
            f"{bw / 1e9 if bw else float('nan'):.0f} GB/s\n\n")
    (out / f"sample_{tag}.md").write_text(head + "\n".join(lines) + "\n")
    print(f"wrote {out / f'sample_{tag}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

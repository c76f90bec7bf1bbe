"""Bench: an A/B of two versions of the decode kernels on the 8B decode step's launches.

Side "this" is this tree; side "other" is the same tree with the files of a directory laid over
`trainers/sampling/kernels/` (make it with `git show REF:trainers/sampling/kernels/<file> >
DIR/<file>` for each file that differs, then carry DIR to the GPU machine). Each side runs in
its own process (Triton compiles each source), the sides alternating for `--rounds` rounds;
every launch is timed back to back, 40 to a CUDA graph with PDL (`bench.lora_t.graph_us`), and
its outputs are compared bit for bit between the sides. Launches, 8 rows, NF4 with double
quant and rank-16 LoRA (`bench.lora_t._parts`): the 8B gate/up + silu · mul launch with LoRA's t
given (`gateup_t`) and without LoRA (`gateup_plain`), down_proj (its split rule's partials,
LoRA in the loop), q/k/v (one launch) and o_proj.

GPU, from the project root (the bench/README install line first):

    python -m bench.ws_ab --other DIR [--rounds 2] [--tag _s40]

Prints µs a launch per side and round and whether the outputs agree; writes
bench/results/ws_ab_<GPU><tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = Path("trainers/sampling/kernels")
TREE = ("trainers", "bench", "grpo_lce")
LAUNCHES = ("gateup_t", "gateup_plain", "down", "qkv", "o")


def side_tree(dest: Path, overlay: Path | None) -> Path:
    """A copy of this tree's packages at dest, with overlay's .py files over the kernels."""
    for name in TREE:
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    if overlay is not None:
        files = sorted(overlay.glob("*.py"))
        if not files:
            raise SystemExit(f"--other {overlay}: no .py files to lay over {KERNELS}")
        for f in files:
            shutil.copy(f, dest / KERNELS / f.name)
    return dest


def _child(out: Path) -> None:
    """One side's round: every launch's µs and outputs (a torch.save of {name: tensors})."""
    import dataclasses

    import torch

    from bench.lora_t import ROWS, _parts, graph_us
    from trainers.sampling.kernels import linear4bit as L
    from trainers.sampling.kernels.rmsnorm import add_rmsnorm
    from trainers.sampling.kernels.split_sum import SplitSum

    dev = torch.device("cuda")
    torch.manual_seed(0)
    k, n = 4096, 14336
    gate_up = _parts(k, (n, n), dev)
    plain = [dataclasses.replace(p, lora_a=None, lora_b=None) for p in gate_up]
    down = _parts(n, (k,), dev)
    qkv = _parts(k, (4096, 1024, 1024), dev)
    o = _parts(k, (4096,), dev)
    delta = SplitSum(torch.randn(2, ROWS, k, device=dev), None, torch.bfloat16, k)
    r = torch.randn(ROWS, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, device=dev, dtype=torch.bfloat16)
    x, _, t = add_rmsnorm(delta, r, w, 1e-5, lora_a=tuple(p.lora_a for p in gate_up))
    h = torch.randn(ROWS, n, device=dev, dtype=torch.bfloat16)
    calls = {"gateup_t": lambda: [L.linear4bit_lora_silu_mul(x, *gate_up, lora_t=t)],
             "gateup_plain": lambda: [L.linear4bit_lora_silu_mul(x, *plain)],
             "down": lambda: L.linear4bit_lora_group(h, down),
             "qkv": lambda: L.linear4bit_lora_group(x, qkv),
             "o": lambda: L.linear4bit_lora_group(x, o)}
    us = {name: graph_us(fn) for name, fn in calls.items()}
    outs = {name: [y.clone() for y in fn()] for name, fn in calls.items()}
    torch.cuda.synchronize()
    torch.save({"us": us, "outs": outs}, out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, help="a directory of kernel files (module docstring)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        return _child(a.child)
    if a.other is None:
        ap.error("--other DIR is required")
    import torch

    from bench import common as bc

    rows, last = [], {}
    with tempfile.TemporaryDirectory(prefix="ws_ab_") as tmp:  # the two trees' copies
        work = Path(tmp)
        trees = {"this": side_tree(work / "this", None),
                 "other": side_tree(work / "other", a.other.resolve())}
        for rnd in range(a.rounds):
            for side, tree in trees.items():
                out = work / f"{side}{rnd}.pt"
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                   if p])}
                subprocess.run([sys.executable, "-m", "bench.ws_ab", "--child", str(out)],
                               cwd=tree, env=env, check=True)
                got = torch.load(out)
                last[side] = got["outs"]
                rows.append({"side": side, "round": rnd, **{f"{k}_us": v for k, v in
                                                           got["us"].items()}})
                print(side, rnd, {k: round(v, 2) for k, v in got["us"].items()}, flush=True)
    same = {name: all(torch.equal(p, q) for p, q in zip(last["this"][name], last["other"][name]))
            for name in LAUNCHES}
    print("outputs bit for bit the same:", same)
    rows.append({"same_bits": same})
    bc.write_rows("ws_ab", a.tag, torch.device("cuda"), rows)
    print(json.dumps({s: {k: min(r[f"{k}_us"] for r in rows if r.get("side") == s)
                          for k in LAUNCHES} for s in ("this", "other")}, indent=1))


if __name__ == "__main__":
    main()

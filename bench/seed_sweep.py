"""The main job over several seeds: the ranges that the README states, measured, not assumed.

Runs `scripts/train_grpo.py` once per seed, each in its own process (as a user would run it),
reads each run's summary.json and writes one JSON with every run, the min-max range of each
number over the seeds, and the machine (CPU model, cores, torch / transformers / TRL versions):
a run is deterministic per seed on one machine, but another CPU or library build can round
differently and sample other completions, so a claim about the outcome needs a range.

    python -m bench.seed_sweep                          # seeds 0-3, the default main job
    python -m bench.seed_sweep --seeds 0-7 --jobs 2     # two runs at a time (tiny: 1 thread each)
    python -m bench.seed_sweep --seeds 0,1 -- --model smollm2   # arguments after -- go to
                                                                  # train_grpo.py

Writes bench/results/seed_sweep_<model>_<cpu>.json (and each run's output under --work-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train_grpo.py")


def parse_seeds(spec: str) -> list[int]:
    """'0-3' or '0,2,5' (or a mix, '0-2,7') -> sorted distinct seeds."""
    seeds = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            seeds.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SystemExit(f"--seeds: expected e.g. 0-3 or 0,2,5, got {spec!r}") from None
    if not seeds:
        raise SystemExit(f"--seeds: no seeds in {spec!r}")
    return sorted(seeds)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(),
            **{p: ver(p) for p in ("torch", "transformers", "trl", "peft")}}


def commit() -> dict:
    """{"commit": HEAD's hash, "tree_modified": whether `git status --porcelain` lists any
    change, untracked files included}: the runs measured that commit plus those changes. Both
    None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip(),
                "tree_modified": bool(git("status", "--porcelain").strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "tree_modified": None}


def run_seed(seed: int, work_dir: str, extra: list[str]) -> dict:
    out = os.path.join(work_dir, f"seed{seed}")
    # the sweep owns its work dir: a rerun with other arguments replaces the earlier runs
    cmd = [sys.executable, TRAIN, "--seed", str(seed), "--output_dir", out,
           "--overwrite_output_dir", *extra]
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(work_dir, f"seed{seed}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"seed": seed, "error": f"exit {proc.returncode}, see {log.name}", "wall_s": wall}
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    row = {"seed": seed, "wall_s": wall}
    for key, value in summary.items():
        if key.startswith("reward_"):
            row[key] = value
        elif key.startswith("eval_") and isinstance(value, dict):
            row.update({f"{key}_{name}": v for name, v in value.items()})
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                       if k not in ("seed", "wall_s")) + f" ({wall:.0f} s)",
          flush=True)
    return row


def ranges(rows: list[dict]) -> dict:
    """{number: [min, max]} over the runs, plus the change of each before/after pair."""
    ok = [r for r in rows if "error" not in r]
    out = {}
    keys = [k for k in (ok[0] if ok else {}) if k != "seed"]
    for k in keys:
        vals = [r[k] for r in ok if k in r]
        out[k] = [min(vals), max(vals)]
    for first, last in (("reward_first", "reward_last"),
                        *((k, k.replace("eval_before", "eval_after")) for k in keys
                          if k.startswith("eval_before"))):
        deltas = [r[last] - r[first] for r in ok if first in r and last in r]
        if deltas:  # change_reward, change_eval_<reward>
            name = first.replace("reward_first", "reward").replace("eval_before", "eval")
            out[f"change_{name}"] = [min(deltas), max(deltas)]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--seeds", default="0-3", help="seeds, e.g. 0-3 or 0,2,5 (default 0-3)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "outputs", "seed_sweep"),
                   help="each run's output directory and log go here")
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/seed_sweep_<model>_<cpu>.json)")
    args = p.parse_args(own)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    seeds = parse_seeds(args.seeds)
    model = extra[extra.index("--model") + 1] if "--model" in extra[:-1] else "tiny"
    info = machine()
    measured = commit()  # before the runs: the code they run
    print(f"{len(seeds)} runs of train_grpo.py {' '.join(extra)} on {info['cpu']} "
          f"({info['cores']} cores), {args.jobs} at a time", flush=True)
    os.makedirs(args.work_dir, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda s: run_seed(s, args.work_dir, extra), seeds))
    result = {"command": ["python", "-m", "bench.seed_sweep", *argv], **measured,
              "train_args": extra, "seeds": seeds, "jobs": args.jobs, "machine": info, "runs": rows,
              "ranges": ranges(rows)}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", info["cpu"]).strip("_")[:40]
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"seed_sweep_{os.path.basename(model)}_{slug}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for k, (lo, hi) in result["ranges"].items():
        print(f"  {k:<32} {lo:8.3f} .. {hi:8.3f}")
    failed = [r["seed"] for r in rows if "error" in r]
    print(f"wrote {out}" + (f"; failed seeds {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The main job over seeds and CPU thread counts: the ranges that the README states, measured.

Runs `scripts/train_grpo.py` once per seed and thread count, each in its own process (as a user
would run it) with OMP_NUM_THREADS set, reads each run's summary.json and writes one JSON with
every run and its gain on the held-out prompts (greedy and sampled), the min-max range of each
number, how many runs gained or lost, and the machine (CPU model, cores, torch / transformers /
TRL versions): a run is deterministic per seed on one machine, but another thread count, CPU or
BLAS rounds differently and samples other completions, so a claim about the outcome needs a
range over both.

    python -m bench.seed_sweep                          # seeds 0-4 x 1, 2 and all threads
    python -m bench.seed_sweep --seeds 0-7 --threads 1 --jobs 2
    python -m bench.seed_sweep --seeds 0,1 -- --model smollm2   # arguments after -- go to
                                                                  # train_grpo.py

"all" threads is os.cpu_count(); a thread count that repeats (2 and all on 2 cores) runs once.
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
from concurrent.futures import ThreadPoolExecutor, as_completed

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
    """{"commit": the checkout's HEAD, "tree_modified": whether tracked files differ from it}."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "tree_modified": None}
    return {"commit": head, "tree_modified": bool(dirty.strip())}


def parse_threads(spec: str) -> list[int]:
    """'1,2,all' -> distinct thread counts in order, 'all' = os.cpu_count()."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        try:
            n = (os.cpu_count() or 1) if part == "all" else int(part)
        except ValueError:
            raise SystemExit(f"--threads: expected e.g. 1,2,all, got {spec!r}") from None
        if n < 1:
            raise SystemExit(f"--threads: counts must be >= 1, got {spec!r}")
        if n not in out:
            out.append(n)
    return out


def run_seed(seed: int, threads: int, work_dir: str, extra: list[str]) -> dict:
    name = f"seed{seed}_threads{threads}"
    out = os.path.join(work_dir, name)
    # the sweep owns its work dir: a rerun with other arguments replaces the earlier runs
    cmd = [sys.executable, TRAIN, "--seed", str(seed), "--output_dir", out,
           "--overwrite_output_dir", *extra]
    # PYTHONPATH: this checkout's trainers/ and grpo_lce/, whatever an editable install points at
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # OMP_WAIT_POLICY=PASSIVE: a thread waiting at a barrier sleeps instead of spinning, so on a
    # busy machine it does not take the CPU from the thread it waits for (no effect on results)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": path}
    os.makedirs(out, exist_ok=True)
    t0, cpu0 = time.perf_counter(), os.times()
    with open(os.path.join(work_dir, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                              check=False)
    cpu1 = os.times()
    # CPU time of this run alone when runs go one at a time (--jobs 1); the sum over runs in
    # flight otherwise. On a shared machine it says more about the cost than wall time.
    row = {"seed": seed, "threads": threads, "wall_s": time.perf_counter() - t0,
           "cpu_s": (cpu1.children_user + cpu1.children_system
                     - cpu0.children_user - cpu0.children_system)}
    if proc.returncode != 0:
        return {**row, "error": f"exit {proc.returncode}, see {log.name}"}
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    for key, value in summary.items():
        if key.startswith("reward_"):
            row[key] = value
        elif key.startswith("eval_") and isinstance(value, dict):
            row.update({f"{key}_{name}": v for name, v in value.items()})
    for before in [k for k in row if "_before_" in k]:
        after = before.replace("_before_", "_after_")
        if after in row:  # gain_eval_<reward>, gain_eval_sampled_<reward>
            row["gain_" + before.replace("_before", "")] = row[after] - row[before]
    print(f"seed {seed}, {threads} thread(s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                      if k not in ("seed", "threads", "wall_s", "cpu_s"))
          + f" ({row['wall_s']:.0f} s)", flush=True)
    return row


def ranges(rows: list[dict]) -> dict:
    """{number: [min, max]} over the runs, plus the change of the training reward."""
    ok = [r for r in rows if "error" not in r]
    out = {}
    keys = [k for k in (ok[0] if ok else {}) if k not in ("seed", "threads")]
    for k in keys:
        vals = [r[k] for r in ok if k in r]
        out[k] = [min(vals), max(vals)]
    deltas = [r["reward_last"] - r["reward_first"] for r in ok
              if "reward_first" in r and "reward_last" in r]
    if deltas:
        out["change_reward"] = [min(deltas), max(deltas)]
    return out


def tally(rows: list[dict]) -> dict:
    """{gain_*: {"gained": n, "same": n, "lost": n}} over the runs."""
    ok = [r for r in rows if "error" not in r]
    out = {}
    for k in [k for k in (ok[0] if ok else {}) if k.startswith("gain_")]:
        gains = [r[k] for r in ok if k in r]
        out[k] = {"gained": sum(g > 0 for g in gains), "same": sum(g == 0 for g in gains),
                  "lost": sum(g < 0 for g in gains)}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--seeds", default="0-4", help="seeds, e.g. 0-4 or 0,2,5 (default 0-4)")
    p.add_argument("--threads", default="1,2,all",
                   help="CPU thread counts (OMP_NUM_THREADS) per seed (default 1,2,all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "outputs", "seed_sweep"),
                   help="each run's output directory and log go here")
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/seed_sweep_<model>_<cpu>.json)")
    args = p.parse_args(own)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    seeds, threads = parse_seeds(args.seeds), parse_threads(args.threads)
    model = extra[extra.index("--model") + 1] if "--model" in extra[:-1] else "tiny"
    info = machine()
    measured = commit()  # before the runs: the code they run
    runs = [(s, t) for s in seeds for t in threads]
    print(f"{len(runs)} runs of train_grpo.py {' '.join(extra)} on {info['cpu']} "
          f"({info['cores']} cores), {args.jobs} at a time", flush=True)
    os.makedirs(args.work_dir, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", info["cpu"]).strip("_")[:40]
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"seed_sweep_{os.path.basename(model)}_{slug}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    head = {"command": ["python", "-m", "bench.seed_sweep", *argv], **measured,
            "train_args": extra, "seeds": seeds, "threads": threads, "jobs": args.jobs,
            "load_average_at_start": os.getloadavg()[0], "machine": info}
    rows = []

    def record(row):
        # rewritten after every run, "complete" false until the last, so a sweep cut short
        # still leaves what it measured
        rows.append(row)
        result = {**head, "complete": len(rows) == len(runs), "runs": sorted(
            rows, key=lambda r: (r["seed"], r["threads"])), "ranges": ranges(rows),
            "tally": tally(rows)}
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return result

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_seed, s, t, args.work_dir, extra) for s, t in runs]
        for future in as_completed(futures):
            result = record(future.result())
    for k, (lo, hi) in result["ranges"].items():
        print(f"  {k:<32} {lo:8.3f} .. {hi:8.3f}")
    for k, t in result["tally"].items():
        print(f"  {k:<32} gained {t['gained']}, same {t['same']}, lost {t['lost']}")
    failed = [(r["seed"], r["threads"]) for r in result["runs"] if "error" in r]
    print(f"wrote {out}" + (f"; failed (seed, threads) {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared helpers of the bench_*.py scripts: timing, peak memory, environment, result files.

Timing on CUDA is `triton.testing.do_bench` (L2 flushed before every call, CUDA events), asked for
the 20/50/80 % quantiles; `rep` is raised so a slow function still gets `min_reps` timed calls.
Without CUDA (the CPU smoke run) it is `time.perf_counter` over the same number of calls.

Extra memory is the peak of `torch.cuda.max_memory_allocated()` during one call, minus what was
allocated before it (inputs already there), so whatever the call returns (gradients, outputs)
counts. None on CPU.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra_bytes(fn, device: torch.device):
    """(fn's result, extra peak bytes of one call); bytes is None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    free_memory()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def time_once_ms(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def time_ms(
    fn, device: torch.device, *, warmup_ms=25, rep_ms=100, min_reps=5, est_ms=None
) -> dict:
    """{'ms': median, 'p20', 'p80', 'spread_pct': (p80 - p20) / median, 'reps'} for fn() calls.

    `est_ms`: a warm call's time if the caller has one (saves an estimating call).
    """
    est = est_ms if est_ms is not None else min(time_once_ms(fn, device) for _ in range(2))
    rep = max(rep_ms, min_reps * est)
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep, quantiles=[0.5, 0.2, 0.8]
        )
        reps = max(1, int(rep / max(est, 1e-3)))
    else:
        reps = max(min_reps, int(rep / max(est, 1e-3)))
        ts = sorted(time_once_ms(fn, device) for _ in range(reps))
        q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) > 1 else ts * 9
        med, p20, p80 = statistics.median(ts), q[1], q[7]
    return {
        "ms": float(med),
        "p20": float(p20),
        "p80": float(p80),
        "spread_pct": float(100.0 * (p80 - p20) / med) if med > 0 else 0.0,
        "reps": reps,
    }


def gpu_short_name(device: torch.device) -> str:
    """'H100' from 'NVIDIA H100 80GB HBM3', 'cpu' without CUDA; used in result file names."""
    if device.type != "cuda":
        return "cpu"
    return short_gpu_name(torch.cuda.get_device_name(device))


def short_gpu_name(name: str) -> str:
    for tok in name.replace("NVIDIA", "").split():
        if re.fullmatch(r"[A-Z]+\d+[A-Za-z]*", tok):
            return tok
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "gpu"


def git_commit() -> str:
    """The measured code's commit: $BENCH_COMMIT where the caller states it (the GPU machine
    receives a copy of the working tree whose .git need not match it), else `git rev-parse HEAD`
    with "+dirty" if tracked files have changes."""
    import os
    import subprocess

    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_tag(device: str) -> str:
    """`gpu_short_name` read from nvidia-smi, for drivers that must not start CUDA themselves
    (their workers measure memory); "cpu" for device "cpu"."""
    import subprocess

    if device != "cuda":
        return "cpu"
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "gpu"
    return short_gpu_name(name)


def env_info(device: torch.device) -> dict:
    info = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def write_rows(stem: str, tag: str, device: torch.device, rows: list) -> Path:
    """{"env", "rows"} to <stem>_<GPU><tag>.json in $OUT (the GPU machine's folder that comes
    back) or bench/results; prints the path."""
    path = Path(os.environ.get("OUT", RESULTS_DIR)) / f"{stem}_{gpu_short_name(device)}{tag}.json"
    write_json(path, {"env": env_info(device), "rows": rows})
    print("wrote", path)
    return path


def parse_jsonl(text: str) -> list[dict]:
    """The records of JSON lines; a line cut short (a killed writer) is passed over."""
    recs = []
    for line in text.splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return recs


def read_jsonl(paths) -> list[dict]:
    """The records of the given .jsonl files, in file order (a missing file has none)."""
    recs = []
    for path in map(Path, paths):
        if path.exists():
            recs += parse_jsonl(path.read_text())
    return recs


def write_report(stem: Path, md: str, records, plot=None) -> None:
    """<stem>.md (the tables), <stem>.json (the records) and, where `plot(path)` draws one,
    <stem>.png; prints the tables."""
    stem.with_suffix(".md").write_text(md)
    write_json(stem.with_suffix(".json"), records)
    if plot is not None and plot(stem.with_suffix(".png")):
        print(f"wrote {stem.with_suffix('.png')}")
    print(md)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 100) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def newest_points(points, key) -> list[dict]:
    """The newest of the point records with the same `key(record)`, a measured one (status
    "ok") winning over a newer one that is not (n/a, skipped, killed)."""
    newest: dict = {}
    for r in points:
        k = key(r)
        if r.get("status") == "ok" or newest.get(k, {}).get("status") != "ok":
            newest[k] = r
    return list(newest.values())


def short_error(exc: BaseException, limit: int = 160) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "OOM"
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(exc).__name__}: {first}"[:limit]

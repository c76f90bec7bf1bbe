"""The driver / worker split of bench.e2e, bench.grpo_step and bench.trainer_step.

Each measured system runs in a worker process of its own (TRL 1.13 and 1.16 cannot share a
process; each system's peak memory starts from a fresh CUDA context), so a driver never starts
CUDA. A worker appends one JSON line per record as soon as it has it; the driver runs the
workers one at a time, kills one past its time, and records a point a failed worker left
unrecorded as a row whose status gives the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import common as bc

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transformers", "trl", "peft", "accelerate", "bitsandbytes", "liger-kernel",
            "datasets")


def add_worker_args(p: argparse.ArgumentParser, *extra: str) -> None:
    """--worker, --system, --model, --jsonl, --deadline (epoch seconds after which a worker
    starts no new point) and the string flags `extra`, all hidden from --help."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--system", "--model", "--jsonl", *extra):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)


def add_run_args(p: argparse.ArgumentParser, *, device: str | None = "cuda") -> None:
    """--device, --model-cache, --out-dir."""
    p.add_argument("--device", default=device, help="cuda, or cpu for the --tiny smoke run")
    p.add_argument("--model-cache", default="/tmp/grpo_lce_e2e_models",
                   help="where the random 1b / 8b models are built once (2.5 / 16 GB)")
    p.add_argument("--out-dir", default=str(bc.RESULTS_DIR))


def worker_argv(module: str, a, names=(), **flags) -> list[str]:
    """`python -m module --worker` with the options `names` of the driver's namespace `a` and
    `flags`: a list joins with ",", True is the bare flag, None and False are left out."""
    argv = [sys.executable, "-m", module, "--worker"]
    for name, v in [*((n, getattr(a, n)) for n in names), *flags.items()]:
        if v is None or v is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if v is not True:
            argv.append(",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))
    return argv


def child_env(**overrides: str) -> dict:
    """The driver's environment for a worker: unbuffered output, offline hub unless set."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **overrides)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


@dataclass
class Run:
    status: str | None  # None: exited with status 0; else why not, as a record's status
    records: list[dict] = field(default_factory=list)  # the lines it appended


def run_worker(argv: list[str], jsonl: Path, *, kill_at: float = float("inf"),
               env: dict | None = None, killed: str = "killed at the time limit") -> Run:
    """Run one worker to its end, or kill it with its children (its own session: torch.compile's
    workers too) at `kill_at` (epoch seconds): status `killed`; a crash: "error: worker exited
    with status N"."""
    jsonl = Path(jsonl)
    start = jsonl.stat().st_size if jsonl.exists() else 0
    proc = subprocess.Popen(argv, env=env or child_env(), cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=None if kill_at == float("inf")
                       else max(1.0, kill_at - time.time()))
        status = None if rc == 0 else f"error: worker exited with status {rc}"
    except subprocess.TimeoutExpired:
        _kill(proc)
        status = killed
    except BaseException:  # Ctrl-C: the worker is in its own session and would outlive us
        _kill(proc)
        raise
    if not jsonl.exists():
        return Run(status)
    with open(jsonl, "rb") as f:
        f.seek(start)
        return Run(status, bc.parse_jsonl(f.read().decode()))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended just now
        pass
    proc.wait()


def unrecorded(run: Run, expected: list[dict], key) -> list[dict]:
    """The `expected` points (record stubs) of which `run` wrote no record with the same key."""
    seen = {key(r) for r in run.records}
    return [e for e in expected if key(e) not in seen]


class Sink:
    """Appends one JSON line per record (`base` fields, the record, its time) and syncs it."""

    def __init__(self, path, **base):
        self.path, self.base = path, base

    def write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({**self.base, **rec, "time": time.time()}, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def worker_env(device: str) -> dict:
    """bench.common.env_info of this process, and the versions of PACKAGES."""
    import torch

    env = bc.env_info(torch.device(device))
    env.update({pkg: bc.package_version(pkg) for pkg in PACKAGES})
    return env

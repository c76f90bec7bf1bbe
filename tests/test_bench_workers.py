"""bench.workers, the driver / worker split of bench.e2e, bench.grpo_step and bench.trainer_step.

Covers: a worker's command line from the driver's options parses back to them; run_worker
returns only the records this run appended, the status of a crashed worker, and kills a worker
past its time together with its child; a line cut short by a kill is passed over. Each driver,
its worker replaced by one that crashes, records the failure as a row of its table with the
reason (no model is built).

    python -m pytest tests/test_bench_workers.py -q
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pytest

from bench import common as bc
from bench import workers as W


def _worker(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_worker_argv_parses_back():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int)
    W.add_run_args(p)
    W.add_worker_args(p, "--part")
    a = argparse.Namespace(lengths=[8, 16], tiny=True, steps=3, device="cpu", model_cache="/m")
    argv = W.worker_argv("bench.x", a, ("lengths", "tiny", "steps", "device", "model_cache"),
                         system="trl", model="1b", jsonl="/r.jsonl", deadline=12.5, part=None,
                         quick=False)
    assert argv[:4] == [sys.executable, "-m", "bench.x", "--worker"]
    assert "--part" not in argv and "--quick" not in argv  # None and False are left out
    b = p.parse_args(argv[3:])
    assert (b.worker, b.lengths, b.tiny, b.steps, b.device, b.model_cache) == (
        True, "8,16", True, 3, "cpu", "/m")
    assert (b.system, b.model, b.jsonl, b.deadline) == ("trl", "1b", "/r.jsonl", 12.5)


def test_run_worker_records_and_crash(tmp_path):
    jsonl = tmp_path / "r.jsonl"
    W.Sink(jsonl, system="old").write({"key": "a"})  # an earlier run's line
    line = 'open(%r, "a").write(\'{"key": "%s"}\\n\')'
    ok = W.run_worker(_worker(line % (str(jsonl), "b")), jsonl)
    assert ok.status is None
    assert [r["key"] for r in ok.records] == ["b"]
    crash = W.run_worker(_worker(line % (str(jsonl), "c") + "; raise SystemExit(3)"), jsonl)
    assert crash.status == "error: worker exited with status 3"
    assert [r["key"] for r in crash.records] == ["c"]
    left = W.unrecorded(crash, [{"key": k} for k in "abcd"], key=lambda r: r["key"])
    assert left == [{"key": "a"}, {"key": "b"}, {"key": "d"}]  # only this run's lines count
    first = bc.read_jsonl([jsonl])[0]
    assert first["system"] == "old" and first["key"] == "a" and "time" in first


@pytest.mark.slow  # waits for a timed kill of a subprocess tree
def test_run_worker_kills_the_worker_and_its_children(tmp_path):
    jsonl, pidfile = tmp_path / "r.jsonl", tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    t0 = time.time()
    run = W.run_worker(_worker(code), jsonl, kill_at=t0 + 3, killed="killed: test")
    assert run.status == "killed: test" and run.records == []
    assert time.time() - t0 < 30
    child = int(pidfile.read_text())
    for _ in range(50):  # the killed child is reaped by init; wait until it is gone
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker's child {child} outlived the kill")


def test_parse_jsonl_passes_over_a_cut_line():
    text = json.dumps({"a": 1}) + "\n" + '{"b": 2, "c"' + "\n\n" + json.dumps({"d": 4}) + "\n"
    assert bc.parse_jsonl(text) == [{"a": 1}, {"d": 4}]


@pytest.fixture
def crashing_worker(monkeypatch):
    """Every driver's worker exits with status 7 before writing anything."""
    monkeypatch.setattr(W, "worker_argv", lambda *a, **k: _worker("raise SystemExit(7)"))


def test_grpo_step_records_a_crashed_worker(tmp_path, crashing_worker):
    from bench import grpo_step

    grpo_step.main(["--tiny", "--device", "cpu", "--systems", "trl", "--out-dir",
                    str(tmp_path)])
    pts = [r for r in bc.read_jsonl([tmp_path / "grpo_step_cpu_tiny.jsonl"])
           if r.get("kind") == "point"]
    # the point it was on carries the reason; the later length was never started
    assert [(r["system"], r["L"], r["status"]) for r in pts] == [
        ("trl", 8, "error: worker exited with status 7")]
    md = (tmp_path / "grpo_step_cpu_tiny.md").read_text()
    assert "| tiny | 4 | 8 | TRL 1.16 | error: worker exited with status 7 |" in md


def test_trainer_step_records_a_crashed_worker(tmp_path, crashing_worker):
    from bench import trainer_step

    trainer_step.main(["--tiny", "--device", "cpu", "--trainers", "dpo", "--systems", "trl",
                       "--parts", "steps,op", "--out-dir", str(tmp_path)])
    recs = bc.read_jsonl([tmp_path / "trainer_step_cpu_tiny.jsonl"])
    assert [(r["kind"], r["status"]) for r in recs] == [
        ("point", "error: worker exited with status 7"),
        ("op", "error: worker exited with status 7")]
    assert recs[0]["trainer"] == "dpo" and recs[0]["system"] == "trl" and recs[0]["commit"]
    md = (tmp_path / "trainer_step_cpu_tiny.md").read_text()
    assert "| tiny | TRL 1.16 | error: worker exited with status 7 |" in md


def test_e2e_records_each_task_of_a_crashing_worker(tmp_path, crashing_worker):
    from bench import e2e

    e2e.main(["--tiny", "--device", "cpu", "--parts", "sft", "--systems", "ours",
              "--out-dir", str(tmp_path)])
    recs = bc.read_jsonl([tmp_path / "e2e_cpu_tiny.jsonl"])
    # one worker per try: a crash blames the task it was on, the next try runs the rest
    keys = [t["key"] for t in e2e.plan(_e2e_args(e2e, tmp_path), "tiny")[0]["tasks"]]
    assert [r["key"] for r in recs] == keys
    assert {r["status"] for r in recs} == {"error: worker exited with status 7"}
    assert "error: worker exited with status 7" in (tmp_path / "e2e_cpu_tiny.md").read_text()


def _e2e_args(e2e, tmp_path):
    a = e2e.build_parser().parse_args(["--tiny", "--device", "cpu", "--parts", "sft",
                                       "--systems", "ours", "--out-dir", str(tmp_path)])
    e2e.resolve(a)
    return a

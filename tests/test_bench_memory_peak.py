"""bench.memory_peak's trace replay (the part that runs without CUDA): the peak of each part of
the last step, the blocks live then with the part that allocated them, frees, and a trace that
lost events.

    python -m pytest tests/test_bench_memory_peak.py -q
"""

import pytest

from bench.memory_peak import MARKER, replay, site, summarize

OURS = {"filename": "/repo/trainers/sampling/loop.py", "line": 7, "name": "_state_for"}
TORCH = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call"}


def _trace(events):
    """events: ("m", part) markers, ("a", addr, size) allocs, ("f", addr) frees."""
    out = []
    for e in events:
        if e[0] == "m":
            out.append({"action": "alloc", "addr": 10**9 + len(out), "size": 512,
                        "frames": [{"filename": "bench/memory_peak.py", "line": 1,
                                    "name": MARKER}]})
            out.append({"action": "free_completed", "addr": 10**9 + len(out) - 1, "size": 512})
        elif e[0] == "a":
            out.append({"action": "alloc", "addr": e[1], "size": e[2], "frames": [TORCH, OURS]})
        else:
            out.append({"action": "free_requested", "addr": e[1]})
            out.append({"action": "free_completed", "addr": e[1]})
    return out


def test_replay_finds_each_parts_peak_of_the_last_step():
    names = ["generation", "loss", "generation", "loss"]
    trace = _trace([
        ("a", 1, 100),                                  # setup, kept
        ("m", "generation"), ("a", 2, 1000),            # step 1: a cache, kept
        ("m", "loss"), ("a", 3, 5000), ("f", 3),        # step 1's loss peak: not reported
        ("m", "generation"), ("a", 4, 30), ("f", 4),
        ("m", "loss"), ("a", 5, 200), ("a", 6, 300), ("f", 5), ("a", 7, 50),
    ])
    peaks = replay(trace, names)
    assert set(peaks) == {(2, "generation"), (2, "loss")}
    assert peaks[(2, "generation")]["peak"] == 1130
    loss = peaks[(2, "loss")]
    assert loss["peak"] == 1600  # 100 + 1000 + 200 + 300, before block 5 is freed
    rows = {(r["allocated_in"], r["bytes"]) for r in summarize(loss["live"])}
    assert rows == {("0:setup", 100), ("1:generation", 1000), ("2:loss", 500)}
    assert all(r["site"] == "/repo/trainers/sampling/loop.py:7 _state_for"
               for r in summarize(loss["live"]))


def test_replay_refuses_a_trace_that_lost_markers():
    with pytest.raises(RuntimeError, match="marker allocations"):
        replay(_trace([("m", "generation"), ("a", 1, 10)]), ["generation", "loss"])


def test_site_skips_torch_frames():
    assert site([TORCH]) == "(no Python frame outside torch)"
    assert site([TORCH, OURS, OURS]).count(" < ") == 1

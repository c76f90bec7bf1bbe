"""bench.grpo_step's report (runs without CUDA): the column that checks issue 27's memory target,
a decode-loop point's first-step training peak against TRL's plus the loop's KV caches.

    python -m pytest tests/test_bench_grpo_step.py -q
"""

from bench.grpo_step import over_trl_and_cache, table

MIB = 2**20


def _record(system, first_peaks, cache_bytes=None):
    """A point's record: one step per peak (loss pass peak, bytes above the model)."""
    steps = [{"generation": {"s": 1.0, "peak_bytes": 0}, "loss": {"s": 0.5, "peak_bytes": p},
              "step": {"s": 2.0}} for p in first_peaks]
    rec = {"system": system, "model": "1b", "batch": 8, "L": 512, "status": "ok", "warmup": 0,
           "steps": steps, "commit": "abc"}
    if cache_bytes is not None:
        rec["loop"] = {"cache_bytes": cache_bytes}
    return rec


def test_over_trl_and_cache_from_first_steps():
    trl = _record("trl", [1000 * MIB])
    # ours: first step 1150.5 MiB with a 150 MiB cache; its later step (optimizer state) is
    # larger and must not count
    ours = _record("ours_loop", [1150.5 * MIB, 1200 * MIB], cache_bytes=150 * MIB)
    assert over_trl_and_cache(ours, trl) == 0.5
    assert over_trl_and_cache(ours, None) is None
    assert over_trl_and_cache(_record("ours_loop", [1 * MIB]), trl) is None  # no cache record
    md = table([trl, ours])
    row = next(line for line in md.splitlines() if "decode loop" in line)
    header = md.splitlines()[0].split(" | ")
    col = header.index("first step over TRL + KV cache MiB")
    assert row.split(" | ")[col] == "+0.50", row
    assert len(row.split("|")) == len(md.splitlines()[0].split("|"))  # every column filled

"""The decode-step profile's arithmetic: two calls' kernel times differenced per token."""

from bench.profile_decode_step import per_step


def test_per_step_cancels_the_prefill_and_divides_by_the_extra_tokens():
    # kernel "a" runs once a step at 10 µs, "b" every other step at 3 µs, "pre" only in the
    # prefill (the same in both calls), "c" only in the longer call's extra steps
    long = {("a", "[1, 48, 4]"): [64, 640.0], ("pre", "[2]"): [1, 50.0],
            ("b", "[3]"): [32, 96.0], ("c", "[4]"): [48, 4.8]}
    short = {("a", "[1, 48, 4]"): [16, 160.0], ("pre", "[2]"): [1, 50.0], ("b", "[3]"): [8, 24.0]}
    rows = per_step(long, short, 48)
    assert [(r["kernel"], r["grid"]) for r in rows] == [("a", "[1, 48, 4]"), ("b", "[3]"),
                                                       ("c", "[4]")]
    a, b, c = rows
    assert (a["launches_per_step"], a["us_per_step"], a["us_per_launch"]) == (1.0, 10.0, 10.0)
    assert (b["launches_per_step"], b["us_per_step"], b["us_per_launch"]) == (0.5, 1.5, 3.0)
    assert c["launches_per_step"] == 1.0 and abs(c["us_per_step"] - 0.1) < 1e-12


def test_timeline_measures_each_kernel_from_the_windows_first_start():
    """--timeline: the middle stretch of kernels, each start and end from the first's start, and
    each start minus the previous kernel's end (negative where PDL launched it early)."""
    from bench.profile_decode_step import timeline

    events = [("x", "[1]", 0.0, 5.0), ("y", "[1]", 100.0, 10.0), ("z", "[2]", 108.0, 4.0),
              ("w", "[3]", 115.0, 1.0)]
    rows = timeline(events, 3)  # from the middle: events 2, 3 (only two left)
    assert [(r["kernel"], r["start_us"], r["end_us"]) for r in rows] == [
        ("z", 0.0, 4.0), ("w", 7.0, 8.0)]
    assert [r["after_prev_end_us"] for r in rows] == [0.0, 3.0]
    rows = timeline(events[:1] * 2 + events, 3)  # the middle is y: z starts 2 µs before y ends
    assert [r["kernel"] for r in rows] == ["y", "z", "w"]
    assert [r["after_prev_end_us"] for r in rows] == [0.0, -2.0, 3.0]

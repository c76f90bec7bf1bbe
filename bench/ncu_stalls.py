"""Where a kernel's warps wait, from an Nsight Compute source page: its warp-state samples by
region and stall reason, its most-sampled instructions, and the instruction mix of its hottest
loop (the most-sampled region).

A region is the set of SASS instructions executed the same number of times: in a kernel whose
loops run a fixed trip count (the decode linear's K loops) each loop's body is one region, and
so is code run once a warp (a prologue, an epilogue, a parked warp's barrier). The page comes
from a report made with `--section SourceCounters --import-source yes`:

    ncu -i report.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz
    python -m bench.ncu_stalls source.csv.gz [--top 20]

(CPU; `bench/results/ncu_gateup_8b_H100_s39_source.csv.gz` is one such page.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_page(path: str) -> tuple[list[str], list[list[str]]]:
    """The page's header and instruction rows (gzip or plain CSV; the kernel-name line that
    precedes the header is skipped)."""
    raw = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    with raw:
        rows = list(csv.reader(io.TextIOWrapper(raw, "utf-8")))
    start = next(i for i, r in enumerate(rows) if SAMPLES in r)
    return rows[start], rows[start + 1:]


def regions(header: list[str], rows: list[list[str]]) -> dict:
    """{executions: (instructions, Counter of samples by stall reason)} over the rows."""
    ix = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out: dict = {}
    for r in rows:
        key = int(_number(r[ix[EXECUTED]]))
        n, c = out.get(key, (0, collections.Counter()))
        for h in reasons:
            c[h[len("stall_"):]] += _number(r[ix[h]])
        out[key] = (n + 1, c)
    return out


def opcode(source: str) -> str:
    """The SASS opcode's name without its predicate and modifiers (`@!P0 LDS.U8 ...` -> LDS)."""
    words = source.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("page", help="the source page (CSV, or CSV.gz)")
    p.add_argument("--top", type=int, default=15, help="instructions listed by samples")
    p.add_argument("--executions", type=int, default=None,
                   help="the region whose instruction mix to print (default: the most sampled)")
    a = p.parse_args(argv)
    header, rows = read_page(a.page)
    ix = {h: i for i, h in enumerate(header)}
    total = sum(_number(r[ix[SAMPLES]]) for r in rows)
    print(f"{len(rows)} instructions, {int(total)} warp samples\n")
    print("| executions | instructions | samples | share | top stall reasons |")
    print("|---|---|---|---|---|")
    by_region = regions(header, rows)
    for key, (n, c) in sorted(by_region.items(), key=lambda kv: -sum(kv[1][1].values())):
        s = sum(c.values())
        if s:
            top = ", ".join(f"{k} {int(v)}" for k, v in c.most_common(5) if v)
            print(f"| {key} | {n} | {int(s)} | {s / total:.1%} | {top} |")
    print(f"\nthe {a.top} most-sampled instructions (index, executions, samples, SASS):")
    order = sorted(range(len(rows)), key=lambda i: -_number(rows[i][ix[SAMPLES]]))
    for i in sorted(order[:a.top]):
        r = rows[i]
        print(f"  {i:5d} {int(_number(r[ix[EXECUTED]])):8d} {int(_number(r[ix[SAMPLES]])):6d}  "
              f"{r[ix['Source']].strip()[:70]}")
    hot = a.executions if a.executions is not None else max(
        by_region, key=lambda k: sum(by_region[k][1].values()))
    mix = collections.Counter(opcode(r[ix["Source"]].strip()) for r in rows
                              if int(_number(r[ix[EXECUTED]])) == hot)
    print(f"\ninstructions executed {hot} times ({sum(mix.values())}):",
          ", ".join(f"{k} {v}" for k, v in mix.most_common(16)))


if __name__ == "__main__":
    main()

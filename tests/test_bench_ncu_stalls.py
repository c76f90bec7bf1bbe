"""bench.ncu_stalls' reading of an Nsight Compute source page: regions by execution count."""

import gzip

from bench import ncu_stalls


def _page(tmp_path, rows):
    header = ["Address", "Source", ncu_stalls.SAMPLES, ncu_stalls.EXECUTED, "stall_wait",
              "stall_barrier", "stall_wait (Not Issued)"]
    lines = ['"Kernel Name","k",', ",".join(f'"{h}"' for h in header)]
    lines += [",".join(f'"{v}"' for v in r) for r in rows]
    path = tmp_path / "page.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_regions_group_by_executions_and_sum_each_reason(tmp_path, capsys):
    # a loop body of two instructions run 64 times, a prologue run 4 times, a parked warp's NOP
    rows = [("0x0", "LDC R1, c[0x0][0x28]", 3, 4, 3, 0, 9),
            ("0x10", "@!P0 LDS.U8 R2, [R2]", 5, 64, 4, 1, 9),
            ("0x20", "HMMA.16816.F32.BF16 R4, R4, R8, R4", 7, 64, 7, 0, 9),
            ("0x30", "NOP", 11, 1, 0, 11, 9)]
    header, data = ncu_stalls.read_page(_page(tmp_path, rows))
    got = ncu_stalls.regions(header, data)
    assert {k: (n, dict(c)) for k, (n, c) in got.items()} == {
        4: (1, {"wait": 3.0, "barrier": 0.0}), 64: (2, {"wait": 11.0, "barrier": 1.0}),
        1: (1, {"wait": 0.0, "barrier": 11.0})}  # "Not Issued" columns are not counted again
    assert [ncu_stalls.opcode(r[1]) for r in data] == ["LDC", "LDS", "HMMA", "NOP"]
    ncu_stalls.main([_page(tmp_path, rows)])
    out = capsys.readouterr().out
    assert "4 instructions, 26 warp samples" in out
    assert "instructions executed 64 times (2): LDS 1, HMMA 1" in out  # the most-sampled region

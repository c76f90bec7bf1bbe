"""bench.ws_ab's two sides: this tree's packages, and the same with a directory's kernel files
laid over trainers/sampling/kernels (the A/B itself needs a GPU)."""

import pytest

from bench import ws_ab


def test_other_side_takes_the_overlay_and_nothing_else(tmp_path):
    overlay = tmp_path / "old"
    overlay.mkdir()
    (overlay / "linear4bit_ws.py").write_text("# the other version\n")
    this = ws_ab.side_tree(tmp_path / "this", None)
    other = ws_ab.side_tree(tmp_path / "other", overlay)
    kernels = ws_ab.KERNELS
    assert (other / kernels / "linear4bit_ws.py").read_text() == "# the other version\n"
    assert (this / kernels / "linear4bit_ws.py").read_text() == \
        (ws_ab.ROOT / kernels / "linear4bit_ws.py").read_text()
    for name in ("_linear4bit_ws_kernel.py", "rmsnorm.py"):  # the rest as this tree's
        assert (other / kernels / name).read_text() == (this / kernels / name).read_text()
    assert not (other / "bench" / "results").exists()  # results stay behind


def test_an_overlay_without_kernel_files_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no .py files"):
        ws_ab.side_tree(tmp_path / "other", tmp_path / "empty")


def test_main_alternates_the_sides_and_compares_their_last_outputs(tmp_path, monkeypatch):
    """The parent's side: each round runs "this" then "other" in a child process (stood in for
    here: each writes the file it is given), keeps every round's µs and compares the last
    round's outputs launch by launch."""
    import torch

    from bench import common as bc

    overlay = tmp_path / "old"
    overlay.mkdir()
    (overlay / "linear4bit_ws.py").write_text("# the other version\n")
    runs = []

    def child(cmd, cwd, env, check):
        side = "other" if str(cwd).endswith("other") else "this"
        runs.append(side)
        us = {name: 10.0 + len(runs) for name in ws_ab.LAUNCHES}
        outs = {name: [torch.ones(2) if side == "this" or name != "down" else torch.zeros(2)]
                for name in ws_ab.LAUNCHES}
        assert str(cwd) in env["PYTHONPATH"].split(":")[0]  # the side's tree comes first
        torch.save({"us": us, "outs": outs}, cmd[-1])
    written = {}
    monkeypatch.setattr(ws_ab.subprocess, "run", child)
    monkeypatch.setattr(bc, "write_rows", lambda stem, tag, device, rows: written.update(
        stem=stem, tag=tag, rows=rows))
    ws_ab.main(["--other", str(overlay), "--rounds", "2", "--tag", "_t"])
    assert runs == ["this", "other", "this", "other"]
    rows = written["rows"]
    assert [(r["side"], r["round"]) for r in rows[:-1]] == [
        ("this", 0), ("other", 0), ("this", 1), ("other", 1)]
    assert rows[0]["gateup_t_us"] == 11.0 and rows[3]["o_us"] == 14.0
    assert rows[-1] == {"same_bits": {name: name != "down" for name in ws_ab.LAUNCHES}}
    assert (written["stem"], written["tag"]) == ("ws_ab", "_t")

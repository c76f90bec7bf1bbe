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

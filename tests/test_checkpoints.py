"""scripts/_checkpoints.py: the manifest written after each save and the check before --resume.

Covers: a manifest lists every file of a checkpoint (ref/ included) and leaves no temporary file;
a truncated adapter or optimizer state, a changed byte of the same length, a missing file are
each named; without a manifest, truncated safetensors and torch archives are caught by their
structure; `latest_checkpoint` skips a damaged checkpoint for the newest whole one with a note;
and end to end, a train_sft.py run writes manifests, and --resume past a truncated optimizer.pt
continues from the checkpoint before it instead of ending in a traceback.

    python -m pytest tests/test_checkpoints.py -q
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

K = importlib.import_module("_checkpoints")
C = importlib.import_module("_common")
train_sft = importlib.import_module("train_sft")


def _checkpoint(path, step=2):
    """A checkpoint directory with the files a resume reads, in their real formats."""
    os.makedirs(os.path.join(path, "ref"), exist_ok=True)
    save_file({"w": torch.randn(16, 8)}, os.path.join(path, "adapter_model.safetensors"))
    save_file({"w": torch.randn(16, 8)}, os.path.join(path, "ref", "adapter_model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.randn(64)}}}, os.path.join(path, "optimizer.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "save_steps": 1}, f)
    return str(path)


def _truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def test_manifest_lists_every_file_and_catches_damage(tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoint-2")
    K.write_manifest(ckpt)
    assert sorted(os.listdir(ckpt)) == sorted(["adapter_model.safetensors", "optimizer.pt",
                                               "trainer_state.json", "ref", K.MANIFEST])
    with open(os.path.join(ckpt, K.MANIFEST)) as f:
        files = json.load(f)["files"]
    assert set(files) == {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json",
                          os.path.join("ref", "adapter_model.safetensors")}
    assert K.checkpoint_problem(ckpt) is None

    opt = os.path.join(ckpt, "optimizer.pt")
    with open(opt, "rb") as f:
        original = f.read()
    _truncate(opt)
    assert "optimizer.pt has" in K.checkpoint_problem(ckpt)
    with open(opt, "wb") as f:  # same length, one byte changed
        f.write(original[:-1] + bytes([original[-1] ^ 1]))
    assert "optimizer.pt differs" in K.checkpoint_problem(ckpt)
    with open(opt, "wb") as f:
        f.write(original)
    assert K.checkpoint_problem(ckpt) is None
    os.remove(os.path.join(ckpt, "ref", "adapter_model.safetensors"))
    assert "missing" in K.checkpoint_problem(ckpt)


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "optimizer.pt",
                                  os.path.join("ref", "adapter_model.safetensors")])
def test_without_manifest_truncation_is_caught_by_structure(tmp_path, name):
    ckpt = _checkpoint(tmp_path / "checkpoint-2")
    assert K.checkpoint_problem(ckpt) is None  # whole files pass the structural check
    _truncate(os.path.join(ckpt, name), keep=0.9)
    problem = K.checkpoint_problem(ckpt)
    assert problem is not None and problem.startswith(name), problem


def test_latest_checkpoint_skips_a_damaged_one(tmp_path, capsys):
    out = str(tmp_path)
    K.write_manifest(_checkpoint(tmp_path / "checkpoint-2", step=2))
    newest = _checkpoint(tmp_path / "checkpoint-4", step=4)
    K.write_manifest(newest)
    _truncate(os.path.join(newest, "adapter_model.safetensors"))
    assert C.latest_checkpoint(out) == os.path.join(out, "checkpoint-2")
    note = capsys.readouterr().out
    assert f"skipping {newest}: adapter_model.safetensors has" in note, note
    # A save cut off before its manifest was renamed into place: the temporary file is ignored
    # and the checkpoint is judged by its files' structure, with a note saying so.
    os.remove(os.path.join(newest, K.MANIFEST))
    with open(os.path.join(newest, K.MANIFEST + ".123.tmp"), "w") as f:
        f.write('{"version": 1, "fi')
    assert C.latest_checkpoint(out) == os.path.join(out, "checkpoint-2")
    assert "adapter_model.safetensors" in capsys.readouterr().out
    os.remove(os.path.join(newest, "adapter_model.safetensors"))
    save_file({"w": torch.randn(4)}, os.path.join(newest, "adapter_model.safetensors"))
    assert C.latest_checkpoint(out) == newest
    assert f"{newest} has no {K.MANIFEST}" in capsys.readouterr().out


@pytest.mark.slow  # two whole-script runs
def test_resume_past_a_truncated_optimizer_state(tmp_path, capsys):
    out = str(tmp_path / "sft")
    fast = ["--batch-size", "8", "--eval-size", "0", "--save-steps", "1", "--max-length", "64",
            "--output-dir", out]
    assert train_sft.main([*fast, "--steps", "2"]) == 0
    for step in (1, 2):
        assert K.checkpoint_problem(os.path.join(out, f"checkpoint-{step}")) is None
        assert os.path.isfile(os.path.join(out, f"checkpoint-{step}", K.MANIFEST))
    _truncate(os.path.join(out, "checkpoint-2", "optimizer.pt"))
    capsys.readouterr()
    assert train_sft.main([*fast, "--steps", "3", "--resume"]) == 0
    log = capsys.readouterr().out
    assert "skipping" in log and "checkpoint-2: optimizer.pt has" in log, log[-2000:]
    assert K.checkpoint_problem(os.path.join(out, "checkpoint-3")) is None
    with open(os.path.join(out, "checkpoint-3", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3

"""A run's output directory: checked before any model loads, and owned by one run.

`check_writable` turns an impossible --output_dir (a path under a regular file, a read-only
directory, a file in its place) into one line. `claim` records the run in <output_dir>/run.json
(the script, the model and every setting that shapes the weights) and refuses a directory that
holds another run's results: a different record, or results with no record. With --resume the
record must match this run's, except for the settings a resumed run may change (the step count,
the checkpoint interval); any mismatch is named. --overwrite_output_dir replaces the other run:
its checkpoint-*/, sft_warmup/ and ref/ are removed, so nothing of it is resumed or left stale.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from _common import UserError, is_main_process, say

RECORD = "run.json"
# A resumed run may train for more steps, and keeps the checkpoint's own save interval.
RESUME_MAY_CHANGE = frozenset({"max_steps", "save_steps"})
# Files and directories that only a run writes: their presence means the directory holds one.
_RESULTS = ("adapter_model.safetensors", "model.safetensors", "metrics.json", "summary.json",
            "sft_warmup")
_STALE_DIRS = ("sft_warmup", "ref")


def check_writable(output_dir: str) -> None:
    """Create output_dir (and its parents) and write a probe file into it, or raise UserError
    with one line naming it."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            reason = "a file is in the way" if os.path.exists(output_dir) else (
                "a parent of it is a file, not a directory")
        raise UserError(f"--output_dir {output_dir}: cannot write there ({reason}); choose "
                        "another --output_dir") from None


def read_record(output_dir: str) -> dict | None:
    try:
        with open(os.path.join(output_dir, RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _holds_results(output_dir: str) -> bool:
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return any(n in _RESULTS or re.fullmatch(r"checkpoint-\d+", n) for n in names)


def differences(old: dict, new: dict, ignore=frozenset()) -> list[str]:
    """'name old -> new' for every recorded setting that differs."""
    if old.get("script") != new.get("script"):  # another script's run: that says it all
        return [f"script {old.get('script')!r} -> {new.get('script')!r}"]
    keys = [k for k in dict.fromkeys([*old, *new]) if k not in ignore]
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def claim(output_dir: str, record: dict, *, resume: bool, overwrite: bool) -> None:
    """Check output_dir against this run's record (see the module docstring), then write the
    record there. Call after `check_writable` and before any model loads."""
    old = read_record(output_dir)
    if resume:
        if old is None:
            say(f"--resume: {output_dir} has no {RECORD}; its settings are not checked")
        else:
            diff = differences(old, record, RESUME_MAY_CHANGE)
            if diff:
                raise UserError(f"--resume: {output_dir} holds a run made with other settings: "
                                f"{'; '.join(diff)} (run.json); resume with that run's "
                                "settings, or start a new run in another --output_dir")
    elif _holds_results(output_dir):
        diff = differences(old, record) if old is not None else ["no run.json"]
        if diff and not overwrite:
            raise UserError(f"--output_dir {output_dir} holds another run ({'; '.join(diff)}); "
                            "choose another --output_dir, add --resume to continue it, or "
                            "--overwrite_output_dir to replace it")
        if diff and is_main_process():
            stale = [n for n in sorted(os.listdir(output_dir))
                     if n in _STALE_DIRS or re.fullmatch(r"checkpoint-\d+", n)]
            for name in stale:
                shutil.rmtree(os.path.join(output_dir, name))
            say(f"--overwrite_output_dir: replacing the run in {output_dir}"
                + (f" (removed {', '.join(stale)})" if stale else ""))
    if not is_main_process():
        return
    tmp = os.path.join(output_dir, RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(output_dir, RECORD))

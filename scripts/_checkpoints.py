"""Checkpoints that say whether they are whole: a manifest written last, checked before --resume.

The Trainer writes checkpoint-N/ in place: the weights, the optimizer, scheduler and RNG states,
then trainer_state.json. A process killed or a disk filled mid-save, or a file damaged later,
leaves a directory that can look complete. `ManifestCallback` runs after each save and writes
checkpoint_manifest.json = {relative path: [size in bytes, sha256]} for every file in the
checkpoint (subdirectories such as the KL reference adapter ref/ included), to a temporary name
first and then renamed: a rename within one directory is atomic, so the manifest either exists
whole or not at all, and it exists only once every file it lists was written.

`checkpoint_problem(path)` says what is wrong with a checkpoint, or None when it is whole:
- with a manifest, every listed file must exist with its size and sha256;
- without one (a checkpoint from before manifests, or a save cut off before its manifest), the
  files the resume reads are checked by their own structure: trainer_state.json parses,
  a .safetensors file is as long as its header says, a torch .pt/.pth/.bin file (a zip
  archive) has its central directory, which is written at its end.

Hashing reads every byte once: about a second per GB, on save and again on resume.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

from trainers.hashing import sha256_file

MANIFEST = "checkpoint_manifest.json"


def _files(path: str) -> list[str]:
    """Every regular file under `path`, relative, sorted, the manifest and temp files aside."""
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            if name == MANIFEST or name.startswith(MANIFEST + "."):
                continue
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, path))
    return sorted(out)


def write_manifest(path: str) -> str:
    """Write `path`/checkpoint_manifest.json for the files now in `path`; return its path."""
    entries = {rel: [os.path.getsize(os.path.join(path, rel)), sha256_file(os.path.join(path, rel))]
               for rel in _files(path)}
    final = os.path.join(path, MANIFEST)
    tmp = f"{final}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # the manifest's bytes reach the disk before its name does
    os.replace(tmp, final)
    return final


def _safetensors_problem(path: str, size: int) -> str | None:
    # Layout: 8-byte little-endian header length n, n bytes of JSON header, then the tensor data,
    # whose extent is the largest data_offsets end in the header.
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"header of {n} bytes but the file has {size}"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "unreadable safetensors header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
              default=0)
    if size != 8 + n + end:
        return f"{size} bytes, its header says {8 + n + end}"
    return None


def _structure_problem(path: str, rel: str) -> str | None:
    size = os.path.getsize(path)
    if rel.endswith(".safetensors"):
        return _safetensors_problem(path, size)
    if rel.endswith((".pt", ".pth", ".bin")):
        if not zipfile.is_zipfile(path):  # torch.save's format: a zip, directory at the end
            return f"{size} bytes and not a whole torch archive (truncated?)"
    elif rel.endswith(".json"):
        try:
            with open(path) as f:
                json.load(f)
        except ValueError as e:
            return f"unreadable JSON ({e})"
    return None


def checkpoint_problem(path: str) -> str | None:
    """What makes checkpoint directory `path` unfit to resume from, or None (see the module's
    docstring). trainer_state.json must hold a global_step in every case."""
    state = os.path.join(path, "trainer_state.json")
    try:
        with open(state) as f:
            ok = "global_step" in json.load(f)
    except (OSError, ValueError, TypeError):
        ok = False
    if not ok:
        return "no readable trainer_state.json (the save was probably cut short)"
    manifest = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable {MANIFEST} ({e})"
        for rel, (size, digest) in files.items():
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                return f"{rel} is missing"
            if os.path.getsize(full) != size:
                return f"{rel} has {os.path.getsize(full)} bytes, {size} when saved"
            if sha256_file(full) != digest:
                return f"{rel} differs from the file saved (sha256)"
        return None
    for rel in _files(path):
        problem = _structure_problem(os.path.join(path, rel), rel)
        if problem:
            return f"{rel}: {problem}"
    return None


def has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def manifest_callback():
    """A `transformers.TrainerCallback` that writes the manifest of each checkpoint just saved.
    Under several processes every rank writes its own RNG state into the checkpoint, so all
    ranks meet at a barrier first and rank 0 writes the manifest."""
    import torch.distributed as dist
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class ManifestCallback(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if state.is_world_process_zero and os.path.isdir(path):
                write_manifest(path)

    return ManifestCallback()

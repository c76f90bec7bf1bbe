"""The sha256 of a file, read in 1 MiB blocks (hashlib.file_digest needs Python 3.11; the package
supports 3.10). Used to check a downloaded wheel and a checkpoint's files."""

from __future__ import annotations

import hashlib


def sha256_file(path: str) -> str:
    """Hex sha256 of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

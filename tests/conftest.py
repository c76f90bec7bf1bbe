"""Shared pytest set-up.

On a machine without CUDA the Triton kernels can only run in Triton's interpreter, and
`TRITON_INTERPRET` is read when a kernel is decorated, so it is set here, before anything imports
triton. With CUDA nothing is changed. Tests marked `gpu` are skipped without CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fused_triton_env(monkeypatch):
    """The Triton backend (the interpreter on CPU) with the fused path and the device-counted
    row layout at their defaults, whatever the caller's environment says."""
    monkeypatch.setenv("GRPO_LCE_BACKEND", "triton")
    monkeypatch.delenv("GRPO_LCE_FUSED", raising=False)
    monkeypatch.delenv("GRPO_LCE_SYNC_CHECKS", raising=False)

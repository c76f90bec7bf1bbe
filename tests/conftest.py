"""Shared pytest set-up.

On a machine without CUDA the Triton kernels can only run in Triton's interpreter, and
`TRITON_INTERPRET` is read when a kernel is decorated, so it is set here, before anything imports
triton. With CUDA nothing is changed. Tests marked `gpu` are skipped without CUDA.

Tests choose a path through grpo_lce._dispatch's seams (`override`, here as the `fused_triton_env`
and `dispatch_override` fixtures) and observe it through `recording()`, not by patching module
attributes.
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (imports triton, so after TRITON_INTERPRET is set)
from grpo_lce._dispatch import override  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fused_triton_env():
    """The Triton backend (the interpreter on CPU) with the fused path and the device-counted
    row layout at their defaults, whatever the caller's environment says."""
    with override(backend="triton", fused=True, sync_checks=False):
        yield


@pytest.fixture
def dispatch_override():
    """`force(backend=, fused=, sync_checks=)`: grpo_lce._dispatch.override for the rest of the
    test, on top of any earlier one (fused_triton_env's included)."""
    with contextlib.ExitStack() as stack:
        yield lambda **choices: stack.enter_context(override(**choices))

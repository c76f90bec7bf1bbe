"""Shared pytest set-up.

On a machine without CUDA the Triton kernels can only run in Triton's interpreter, and
`TRITON_INTERPRET` is read when a kernel is decorated, so it is set here, before anything imports
triton. With CUDA nothing is changed. Tests marked `gpu` are skipped without CUDA.

Tests choose a path through grpo_lce._dispatch's seams (`override`, here as the `fused_triton_env`
and `dispatch_override` fixtures) and observe it through `recording()`, not by patching module
attributes.

`GRPO_LCE_TEST_THREADS=N` runs the whole suite with `torch.set_num_threads(N)` (set here, before
any test), so that a run on one machine can take the summation orders of another's thread count:

    GRPO_LCE_TEST_THREADS=1 python -m pytest -m "not gpu and not slow" -q

Unset, torch keeps its default (OMP_NUM_THREADS, else the number of cores). It sets the pytest
process only: subprocesses a test starts keep their own setting (the DDP ranks run with
OMP_NUM_THREADS=1).
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _test_threads() -> int | None:
    value = os.environ.get("GRPO_LCE_TEST_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(
            f"GRPO_LCE_TEST_THREADS must be a positive integer, got {value!r}")
    return int(value)


if (_threads := _test_threads()) is not None:
    torch.set_num_threads(_threads)

# (imports triton, so after TRITON_INTERPRET is set)
from grpo_lce._dispatch import override  # noqa: E402


def pytest_report_header(config):
    return (f"torch threads: {torch.get_num_threads()} (GRPO_LCE_TEST_THREADS="
            f"{os.environ.get('GRPO_LCE_TEST_THREADS')}, OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS')})")


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

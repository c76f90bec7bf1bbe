"""A mutation check for the trainer tests, loaded only on request: every call of the one gate the
trainers share, `trainers.base.FusedHeadMixin._lce_falls_back`, answers "fall back", so every
call goes to TRL's own code. A test that compares ours with TRL or fp64 must fail under it.

    PYTHONPATH=tests python -m pytest -p _force_fallback -p no:cacheprovider -q \\
        tests/test_trainers_grpo.py

GRPO_LCE_FORCE_FALLBACK=silent (default) falls back without logging or recording a reason (a
regression nobody logged: only `grpo_lce._dispatch.recording()` can notice it); =logged goes
through the gate's own logging with the reason "forced" (`_lce_fallbacks_logged` notices it).
The gate is replaced for the whole session (module-scoped fixtures included, which build and run
trainers before any function-scoped fixture could patch), in the pytest process only: the DDP
worker processes of tests/test_ddp.py keep the real gate, and its single-process reference, run
in the pytest process, is what falls back. Nothing here is imported unless pytest is given
`-p _force_fallback`.
"""

from __future__ import annotations

import os

import pytest

_MODES = ("silent", "logged")


def pytest_configure(config):
    mode = os.environ.get("GRPO_LCE_FORCE_FALLBACK", "silent")
    if mode not in _MODES:
        raise pytest.UsageError(f"GRPO_LCE_FORCE_FALLBACK must be one of {_MODES}, got {mode!r}")
    config._force_fallback_mode = mode
    # imported here: tests/conftest.py, loaded before pytest_configure, sets TRITON_INTERPRET
    from trainers.base import FusedHeadMixin

    original = FusedHeadMixin.__dict__["_lce_falls_back"]
    if mode == "logged":
        def falls_back(self, reason):
            return original(self, reason or "forced")
    else:
        def falls_back(self, reason):
            return True
    FusedHeadMixin._lce_falls_back = falls_back
    config.add_cleanup(lambda: setattr(FusedHeadMixin, "_lce_falls_back", original))


def pytest_report_header(config):
    return (f"grpo_lce mutation: FusedHeadMixin._lce_falls_back always falls back "
            f"({config._force_fallback_mode})")

"""Whether Triton runs here, probed once at import: the mechanism the dispatcher
(grpo_lce._dispatch) chooses between, so every kernel module imports these flags from here.
"""

from __future__ import annotations

import importlib
import os


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


# triton is optional: without it every call takes the torch path. The fused GEMMs load and store
# through its tensor descriptors, which older versions lack: without them the fused path is off.
HAS_TRITON = _importable("triton.language")
HAS_TMA = HAS_TRITON and _importable("triton.tools.tensor_descriptor")


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"

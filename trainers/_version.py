"""The TRL versions these trainers are written against, checked when a trainer is constructed.

The subclasses override private TRL methods (`GRPOTrainer._get_per_token_logps_and_entropies`)
and reproduce `SFTTrainer.compute_loss`'s metric bookkeeping, both of which TRL changes between
minor releases without notice. So the supported range is one minor series, and anything outside
it is refused with a message instead of training with silently different semantics.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

SUPPORTED_TRL = ">=1.16,<1.17"
_SUPPORTED_MINOR = (1, 16)


def check_trl_version(trainer_name: str) -> None:
    """Raise RuntimeError unless the installed TRL is 1.16.x (pre-releases of 1.16 included).

    `trl.__version__` is read at call time, not import time, so the check follows the TRL
    that is actually loaded.
    """
    import trl

    found = getattr(trl, "__version__", "unknown")
    try:
        release = Version(found).release[:2]
    except InvalidVersion:
        release = None
    if release != _SUPPORTED_MINOR:
        raise RuntimeError(
            f"trainers.{trainer_name} supports trl{SUPPORTED_TRL}, but trl=={found} is installed. "
            f"It overrides TRL internals that change between minor releases; install "
            f"'trl{SUPPORTED_TRL}' or use trl.{trainer_name} directly."
        )

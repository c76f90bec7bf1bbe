"""`trainers` under a name no user package shadows: `import grpo_lce_trainers`.

This project's drop-in TRL trainers live in the top-level package `trainers`, a generic name: a
user's own `trainers/` package earlier on `sys.path` (the script's directory, the working
directory) wins, and `from trainers import GRPOTrainer` then fails with an ImportError. This
module loads the project's `trainers/` directory, found beside this file, as the package
`grpo_lce_trainers` (its modules import each other relatively, and its `__init__` loads them by
relative name, so the whole package resolves under the new name and never looks up `trainers`):

    from grpo_lce_trainers import GRPOTrainer, SFTTrainer
    from grpo_lce_trainers.tiny import tiny_model_dir

Use one name per process: the classes of `grpo_lce_trainers` and `trainers` are distinct objects.
"""

import importlib.util
import os
import sys

_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainers")

_spec = importlib.util.spec_from_file_location(
    __name__, os.path.join(_PACKAGE_DIR, "__init__.py"), submodule_search_locations=[_PACKAGE_DIR]
)
_module = importlib.util.module_from_spec(_spec)
# Replace this module with the package before running it, so that its relative imports
# (`from .grpo import ...`) find `grpo_lce_trainers` in sys.modules.
sys.modules[__name__] = _module
_spec.loader.exec_module(_module)

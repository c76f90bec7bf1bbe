"""`grpo_lce_trainers`: the project's trainers under a name a user's own `trainers/` cannot shadow.

Covers: in a fresh interpreter whose working directory holds a `trainers/` package of its own
(first on sys.path, as a user's project would be), `import trainers` gets the user's package
while `grpo_lce_trainers` gives this project's GRPOTrainer, SFTTrainer and submodules, from the
repository and from an installed wheel (built from this checkout, unpacked into a directory);
nothing inside the package looks up the name `trainers`.

    python -m pytest tests/test_import_alias.py -q
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run with the user's directory first on sys.path (python -c puts the working directory there).
CHECK = r"""
import sys
import trainers
assert trainers.USER, "the user's trainers package should win the plain name"
import grpo_lce_trainers as t
from grpo_lce_trainers import GRPOTrainer, SFTTrainer
from grpo_lce_trainers.tiny import build_tokenizer
import trl
assert issubclass(GRPOTrainer, trl.GRPOTrainer) and issubclass(SFTTrainer, trl.SFTTrainer)
assert GRPOTrainer.__module__ == "grpo_lce_trainers.grpo", GRPOTrainer.__module__
assert len(build_tokenizer()) > 100
assert sys.modules["trainers"] is trainers  # the user's package was not replaced
print("alias from", t.__file__)
"""


def _user_project(tmp_path):
    user = tmp_path / "user_project"
    (user / "trainers").mkdir(parents=True)
    (user / "trainers" / "__init__.py").write_text("USER = True  # a user's own package\n")
    return user


def _run(cwd, pythonpath):
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-c", CHECK], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_alias_beats_a_users_trainers_package_in_the_repository(tmp_path):
    proc = _run(_user_project(tmp_path), ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.join(ROOT, "trainers", "__init__.py") in proc.stdout


def test_alias_from_an_installed_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), ROOT], capture_output=True, text=True, timeout=300, check=False)
    if build.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip().splitlines()[-1:]}")
    (wheel,) = wheels.glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:  # a pure-Python wheel installs by unpacking
        names = zf.namelist()
        zf.extractall(site)
    assert "grpo_lce_trainers.py" in names and "trainers/__init__.py" in names
    proc = _run(_user_project(tmp_path), str(site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(site / "trainers" / "__init__.py") in proc.stdout


def test_trainers_package_never_imports_itself_by_name():
    # An absolute `from trainers...` inside the package would load the user's trainers/ under
    # the alias; only relative imports resolve to the alias's own modules.
    offenders = []
    for name in sorted(os.listdir(os.path.join(ROOT, "trainers"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "trainers", name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            if any(m == "trainers" or m.startswith("trainers.") for m in mods):
                offenders.append(f"trainers/{name}:{node.lineno}")
    assert not offenders, offenders

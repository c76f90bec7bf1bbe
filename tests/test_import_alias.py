"""`grpo_lce_trainers`: the project's trainers under a name a user's own `trainers/` cannot shadow.

Covers: in a fresh interpreter whose working directory holds a `trainers/` package of its own
(first on sys.path, as a user's project would be), `import trainers` gets the user's package while
`grpo_lce_trainers` gives this project's trainers (GRPO, SFT, RLOO, DPO, KTO) and submodules, from
the repository and from an installed wheel (built from this checkout, unpacked into a directory);
nothing inside the package looks up the name `trainers`. And, under both names, the lazy package
`__init__`: importing it or its light modules (`config`, `tiny`) loads neither the trainers nor
TRL's trainer modules; the exported names load their module on first access; `__all__`, `dir()` and
`from ... import *` agree.

    python -m pytest tests/test_import_alias.py -q
"""

from __future__ import annotations

import ast
import os
import pathlib
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
from grpo_lce_trainers import DistillationTrainer, GRPOTrainer, SFTTrainer
from grpo_lce_trainers import DPOTrainer, KTOTrainer, RLOOTrainer
from grpo_lce_trainers.tiny import build_tokenizer
import trl
assert issubclass(GRPOTrainer, trl.GRPOTrainer) and issubclass(SFTTrainer, trl.SFTTrainer)
assert GRPOTrainer.__module__ == "grpo_lce_trainers.grpo", GRPOTrainer.__module__
assert issubclass(DistillationTrainer, trl.DistillationTrainer)
assert DistillationTrainer.__module__ == "grpo_lce_trainers.distillation"
for cls in (DPOTrainer, KTOTrainer, RLOOTrainer):
    assert issubclass(cls, getattr(trl, cls.__name__)), cls
    assert cls.__module__ == "grpo_lce_trainers." + cls.__name__[:-7].lower(), cls.__module__
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


@pytest.mark.slow  # a fresh interpreter importing TRL
def test_alias_beats_a_users_trainers_package_in_the_repository(tmp_path):
    proc = _run(_user_project(tmp_path), ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.join(ROOT, "trainers", "__init__.py") in proc.stdout


@pytest.mark.slow  # builds a wheel, then a fresh interpreter
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
    for path in sorted(pathlib.Path(ROOT, "trainers").rglob("*.py")):  # subpackages too
        name = path.relative_to(pathlib.Path(ROOT, "trainers")).as_posix()
        with open(path) as f:
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


# Run as `python -c LAZY <package name>`: the package under either of its names.
LAZY = r"""
import importlib
import sys

name = sys.argv[1]
heavy = [f"{name}.{m}" for m in ("grpo", "sft", "rloo", "dpo", "kto", "distillation",
                                  "fused_forward", "base", "packing", "attention", "head",
                                  "generation")]
heavy += [f"trl.trainer.{m}_trainer" for m in ("grpo", "sft", "rloo", "dpo", "kto",
                                                "distillation")]

def loaded():
    return [m for m in heavy if m in sys.modules]

pkg = importlib.import_module(name)
assert loaded() == [] and not any(m.startswith(name + ".") for m in sys.modules), loaded()
config = importlib.import_module(f"{name}.config")
importlib.import_module(f"{name}.tiny")
assert loaded() == [], loaded()
assert pkg.GRPOConfig is config.GRPOConfig and pkg.SUPPORTED_TRL == ">=1.16,<1.17"
assert loaded() == [], loaded()
assert set(pkg.__all__) == {"GRPOConfig", "GRPOTrainer", "SFTTrainer", "RLOOTrainer",
                            "DPOTrainer", "KTOTrainer", "DistillationTrainer", "SUPPORTED_TRL"}
assert set(pkg.__all__) <= set(dir(pkg)), dir(pkg)
try:
    pkg.NotAName
except AttributeError as e:
    assert "NotAName" in str(e)
else:
    raise AssertionError("NotAName resolved")
assert pkg.GRPOTrainer.__module__ == f"{name}.grpo"
names = {}
exec(f"from {name} import *", names)
assert set(pkg.__all__) <= set(names) and names["SFTTrainer"].__module__ == f"{name}.sft"
assert pkg.GRPOTrainer is sys.modules[f"{name}.grpo"].GRPOTrainer
assert pkg.DistillationTrainer.__module__ == f"{name}.distillation"
assert names["KTOTrainer"].__module__ == f"{name}.kto"
assert name == "trainers" or "trainers" not in sys.modules  # the alias never loads `trainers`
print("ok")
"""


# a fresh interpreter each; the alias's case stays in the default suite
@pytest.mark.parametrize("name", [pytest.param("trainers", marks=pytest.mark.slow),
                                  "grpo_lce_trainers"])
def test_lazy_package_init(name):
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", LAZY, name], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]

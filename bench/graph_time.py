"""GPU time inside CUDA-graph replays, for splitting a decode step into "inside the captured
graphs" and "outside them" (Python, eager kernels, host syncs).

    with GraphReplayTimer() as g:
        sampler.generate(...)
    g.seconds()      # Σ over replays of the GPU time between CUDA events recorded just before
                     # and just after each replay on the current stream; g.replays: their count

Every CUDA graph torch replays goes through `torch.cuda.CUDAGraph.replay` (hand-captured
graphs and inductor's CUDA-graph trees alike). For the duration of the `with` block that method
is wrapped on the class (a benchmark-only patch, restored on exit) to record the two events.
The start event completes when the stream reaches it, so a gap while the GPU waited for the
host is not counted: the sum is the graphs' own execution time. Events are read after the
block (one synchronize), so timing adds no host sync per replay.
"""

from __future__ import annotations

import torch


class GraphReplayTimer:
    def __init__(self):
        self._pairs: list[tuple] = []
        self._orig = None

    @property
    def replays(self) -> int:
        return len(self._pairs)

    def __enter__(self):
        if not torch.cuda.is_available():
            return self
        cls = torch.cuda.CUDAGraph
        orig = self._orig = cls.replay
        pairs = self._pairs

        def replay(graph, *args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = orig(graph, *args, **kwargs)
            end.record()
            pairs.append((start, end))
            return out

        cls.replay = replay
        return self

    def __exit__(self, *exc):
        if self._orig is not None:
            torch.cuda.CUDAGraph.replay = self._orig
            self._orig = None
        return False

    def seconds(self) -> float:
        if not self._pairs:
            return 0.0
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self._pairs) / 1e3

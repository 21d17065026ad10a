"""The context step (a prompt chunk stored as a request arrives) and its measurement.

A decode step stores the Qb rows of the last verified block; a context step stores a whole prompt
chunk of `chunk` rows per request, every layer, then runs the drafter attention over the new
length (the request's first block is drafted right after). It is where blocking host copies
showed up in practice (per-request page arithmetic on the host), so it gets the same timing, split
and host-sync measurement as the decode step (`tuner.measure`).

`ContextStep` is a `tuner.step.DecodeStep` whose store writes `chunk` rows (all valid, a device
tensor) instead of the block's Qb rows; everything else, re-runnable graphs included, is the
decode step's.
"""

from __future__ import annotations

import torch

from drafter_attn.tuner.measure import measure_step
from drafter_attn.tuner.step import DecodeStep


class ContextStep(DecodeStep):
    """Per layer: store a prompt chunk of `chunk` rows per request at [P, P + chunk), then the
    attention of the block at P + chunk. `problem.ctx_len` is P (0: a request's first chunk)."""

    def __init__(self, problem, backend="cupy", params=None, *, chunk: int, device="cuda", seed: int = 0,
                 **step_options):
        if not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        self.chunk = chunk  # read through store_rows while the base class builds the step
        super().__init__(problem, backend, params, accepted=None, device=device, seed=seed, **step_options)
        self.num_new_rows = [chunk] * problem.batch
        self.num_new = torch.full((problem.batch,), chunk, dtype=torch.int32, device=self.device)
        self._lens_stored = (self._lens_start + self.num_new).contiguous()

    @property
    def store_rows(self) -> int:
        return self.chunk


def measure_context(wire: dict, chunk: int, *, reps: int = 0, **step_options) -> dict:
    """Measure the context step of `wire` (Candidate.to_wire()) on the current GPU -> result
    columns, as tuner.measure.measure_candidate does for a decode step (with the same
    `step_options`). Never raises."""
    return measure_step(wire, lambda c, backend: ContextStep(c.problem, backend, c.params_dict,
                                                             chunk=chunk, **step_options),
                        reps=reps, nsys_note="nsys layer: not run for context steps")

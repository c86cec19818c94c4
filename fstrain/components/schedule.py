"""When periodic work runs in the training loop, and how a step is named across a reshard.

A run resumed on a resharded output (``fsdata balance OLD NEW --from-step S``, then ``fstrain
train NEW --resume``) trains NEW's steps ``0, 1, ...``: the *shards' step* (rows' ``step``,
``step_times.parquet``, the reader). The *global step* continues OLD's: ``global = shards step +
S`` (checkpoint names, ``--max-steps``, TensorBoard). Periods given in steps (``--checkpoint-every-steps``,
``--eval-every-steps``, ``--log-every-steps``) run on the global step, so a checkpoint or an
evaluation lands on the same global steps as in an uninterrupted run; ``--eval-every-epochs``
counts the epochs of the shards being trained (NEW's epoch 0 is the rest of the epoch S fell
in), at their exact boundaries. Without a reshard both steps are the same number.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepSchedule:
    """A period on the global step plus explicit steps of the shards.

    Attributes:
        every_steps: due when ``(step + step_offset) % every_steps == 0``; 0: never by period.
        at_steps: also due after exactly these steps of the shards (e.g. epoch ends).
        step_offset: the global step of the shards' step 0 (the reshard's S; else 0).
        epoch_first_steps: the shards' epoch boundaries (``Manifest.epoch_first_steps()``, ``E+1``
            ints, last = ``num_steps``), for :meth:`epoch`; None: no epochs known.
    """

    every_steps: int = 0
    at_steps: frozenset[int] = frozenset()
    step_offset: int = 0
    epoch_first_steps: tuple[int, ...] | None = None

    def due(self, step: int) -> bool:
        """Whether the work runs after ``step`` steps of the shards (see the attributes)."""
        return bool(self.every_steps and (step + self.step_offset) % self.every_steps == 0) or step in self.at_steps

    def global_step(self, step: int) -> int:
        """The global step of ``step`` steps of the shards done."""
        return step + self.step_offset

    def label(self, step: int) -> str:
        """``"step 5"``, or ``"step 5 (global step 105)"`` on a resharded run (for log lines)."""
        return f"step {step}" + (f" (global step {step + self.step_offset})" if self.step_offset else "")

    def epoch(self, step: int) -> float | None:
        """Epochs of the shards done after ``step`` steps: ``e + (step - first[e]) / (first[e+1] -
        first[e])`` for ``step`` in epoch ``e`` (exact for unequal epochs: a resharded output's
        partial first epoch, cost-budget); None without ``epoch_first_steps``."""
        first = self.epoch_first_steps
        if not first or len(first) < 2:
            return None
        e = min(max(bisect.bisect_right(first, step) - 1, 0), len(first) - 2)
        span = first[e + 1] - first[e]
        return e + ((step - first[e]) / span if span else 0.0)

    @classmethod
    def evaluation(cls, epoch_first_steps, *, every_steps: int, every_epochs: int, step_offset: int = 0
                   ) -> "StepSchedule":
        """When the training loop evaluates (``--eval-every-epochs``, else ``--eval-every-steps``): at
        the end of every ``every_epochs``-th epoch of the shards, else every ``every_steps`` global
        steps (docs/fstrain.md, "Changing the world size"); the epochs known either way (records carry them)."""
        schedule = cls.epochs(epoch_first_steps, every_epochs, step_offset)
        return schedule if every_epochs else cls(every_steps=every_steps, step_offset=step_offset,
                                                 epoch_first_steps=schedule.epoch_first_steps)

    @classmethod
    def epochs(cls, epoch_first_steps, every_epochs: int, step_offset: int = 0) -> "StepSchedule":
        """Due at the end of every ``every_epochs``-th epoch of the shards (their exact boundaries)."""
        first = tuple(int(x) for x in epoch_first_steps)
        ends = first[1:][every_epochs - 1::every_epochs] if every_epochs > 0 else ()
        return cls(at_steps=frozenset(ends), step_offset=step_offset, epoch_first_steps=first)

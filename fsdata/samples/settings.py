"""The settings of converting an interaction log to samples (``fsdata convert``; the nightly job's
``convert`` section): one home for their names, defaults, choices and help texts.

A command line is generated from the fields and their docstrings (the nightly job,
:mod:`pipelines.nightly.config`); ``tests/pipelines/test_nightly_config.py`` checks that
``fsdata convert`` declares the same defaults and choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: Input formats a log can have; ``samples`` (Parquet already in the sample schema) skips conversion.
LOG_FORMATS = ("sequences", "events")
#: One sample per user or per interaction (``--samples``).
SAMPLE_MODES = ("per-user", "per-event")
#: What a text line with the wrong number of fields does (``--bad-lines``).
BAD_LINES = ("error", "skip")
#: Longest history kept (``seq_len`` is int32).
MAX_SEQ_LEN = 2**31 - 1


@dataclass(kw_only=True, slots=True)
class ConvertSettings:
    """How an interaction log becomes samples (the arguments of :func:`fsdata.samples.convert.convert`).

    Raises (on construction):
        ConfigError: an unknown ``samples`` or ``bad_lines`` value, or ``max_seq_len`` outside
            ``1 .. 2^31-1``; one line naming the flag (the format is checked by its reader:
            :func:`~fsdata.samples.convert.convert` converts logs only).
    """

    input: str | None = None
    """The log (format sequences or events) or sample Parquet file, folder or glob (format samples)."""
    format: Literal["sequences", "events", "samples"] = "sequences"
    """sequences: 'user item1 item2 ...' lines; events: one interaction per row; samples: Parquet
    already in the sample schema (no conversion)."""
    samples: Literal["per-user", "per-event"] = "per-event"
    """One sample per user or per interaction."""
    max_seq_len: int = 512
    """Most recent history items kept per sample."""
    user_col: str | None = None
    """events: user column name or 0-based position (default: a header's user_id/userId/user, else column 0)."""
    item_col: str | None = None
    """events: item column name or 0-based position (default: a header's item_id/itemId/item/movieId, else
    column 1)."""
    time_col: str | None = None
    """events: timestamp column (optional; sorts each user's events)."""
    sep: str | None = None
    """events text separator: ',' ';' tab '::' or space (default: sniffed from the first lines)."""
    has_header: bool | None = field(default=None, metadata={"flag": "--header"})
    """events text has a header line (default: sniffed: a line naming standard columns, or no number where
    the data has one)."""
    feature_cols: str | None = None
    """events: extra numeric event columns (e.g. 'rating,action') written as lists aligned with item_ids."""
    bad_lines: Literal["error", "skip"] = "error"
    """events text: a line with the wrong number of fields stops convert (error, naming it) or is skipped and
    counted (skip)."""
    remap_ids: bool = False
    """events: map integer ids to dense indices from 1 too (string ids always are); writes OUTPUT.vocab/."""
    vocab: str | None = None
    """events: an earlier OUTPUT.vocab folder (read only): its ids keep their indices, new ids are appended."""

    def __post_init__(self) -> None:
        from fsdata.errors import ConfigError  # noqa: PLC0415

        if self.bad_lines not in BAD_LINES:
            raise ConfigError(f"unknown --bad-lines '{self.bad_lines}'; use one of {', '.join(BAD_LINES)}")
        if self.samples not in SAMPLE_MODES:
            raise ConfigError(f"unknown --samples '{self.samples}'; use one of {', '.join(SAMPLE_MODES)}")
        if not 1 <= self.max_seq_len <= MAX_SEQ_LEN:
            raise ConfigError(f"--max-seq-len must be an integer in 1..{MAX_SEQ_LEN}, got {self.max_seq_len}")

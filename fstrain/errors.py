"""Typed errors for user mistakes in fstrain.

Every error a user can cause (shards written for another world size, a corrupt shard file, an
impossible setting) is an :class:`FstrainError` whose message is one line naming the problem, the
numbers involved and the fix. ``fstrain`` prints it on stderr and exits non-zero.
"""


class FstrainError(Exception):
    """A user-facing error: bad shards or impossible settings (one-line message with the fix).

    Attributes:
        rank_local: only the raising rank can see the problem (set by :func:`fstrain.train.train`
            on errors raised while stepping); under torchrun that rank prints it. Errors raised
            before the first step are the same on every rank, and only rank 0 prints them.
    """

    rank_local: bool = False


class ShardError(FstrainError):
    """A shard output is missing, corrupt, truncated, or violates docs/format.md."""


class ShardMismatchError(ShardError):
    """The shards do not fit this job (``num_ranks`` != world size, unequal steps, bad version).

    Raised on every rank before any collective runs, so a mismatch never hangs a job.
    """


class ConfigError(FstrainError):
    """An impossible or unknown setting (e.g. ``--max-steps 0``, an unknown cost model)."""

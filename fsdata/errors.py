"""Typed errors for user mistakes.

Every error a user can cause (bad input, impossible settings) is an :class:`FsdataError` whose
message names the problem and the fix. The CLI prints it as one line on stderr and exits non-zero.
"""


class FsdataError(Exception):
    """A user-facing error: bad input data or impossible settings.

    The message is one line that names the problem, the numbers involved and the fix.
    """


class InputError(FsdataError):
    """The input data is missing, empty, corrupt, or does not match the sample schema."""


class ConfigError(FsdataError):
    """The settings are impossible (e.g. ``--ranks 0``) or name something unknown."""


class VerifyError(FsdataError):
    """A written output violates an invariant of the shard format (see docs/format.md)."""

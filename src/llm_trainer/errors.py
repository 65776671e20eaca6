"""The one exception type for mistakes the user can fix.

Anything raised as `UsageError` (or `ValueError` from config validation) is shown by the CLI as a
single line and exits with status 2; everything else is a bug and keeps its traceback.
"""


class UsageError(ValueError):
    """A problem with the user's input (config, files, flags), with a message that says how to fix it."""


class CheckpointError(UsageError):
    """A checkpoint could not be written or read; the message says which and why."""


class StoreFull(UsageError):
    """An object store refused a write for lack of space or quota (its own error in the message): object
    stores publish no free space or quota to ask beforehand, so this refusal is the only sign."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps); the message says what to do. Exit status 1."""


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first non-empty line of an exception's message (its type's name when it has none), cut to
    `limit` characters (None: whole): what a one-line error quotes of the failure below it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:limit]

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

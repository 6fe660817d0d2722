"""User-facing errors: short messages that say what was wrong and how to fix it."""


class EagleSpecError(Exception):
    """An error caused by the user's input or environment (bad option, missing package, corrupt file).

    The CLI prints only the message (no traceback) and exits with `exit_code`.
    """

    exit_code = 2


class MissingPackageError(EagleSpecError):
    """A Python package needed for the requested feature is not installed."""

    def __init__(self, what: str, pip_command: str):
        super().__init__(f"{what} is not installed; install it with: {pip_command}")
        self.pip_command = pip_command


class HeadMismatchError(EagleSpecError):
    """A draft head was trained for a different target model."""


class CheckpointError(EagleSpecError):
    """A checkpoint directory is missing files or holds corrupt/unexpected data."""

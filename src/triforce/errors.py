"""User-facing errors: raised for bad input, printed by the CLI without a traceback."""


class TriforceError(Exception):
    """A problem the user can fix. The message names the problem and the fix."""

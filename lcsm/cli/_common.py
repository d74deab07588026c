"""What every command module shares."""


class UsageError(Exception):
    """A problem with what the user asked for (reported without a traceback)."""

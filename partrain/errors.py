"""The one exception type that the CLI turns into a clear message and exit code 2."""


class ConfigError(Exception):
    """Bad usage, config or input file: the message names the key, the value and the rule."""


def reason(e: OSError) -> str:
    """An OSError in words, for a message ("Permission denied")."""
    return e.strerror or str(e)

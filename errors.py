"""The project's bad-input error: library code raises it, command lines print it as one line and exit 2."""


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""

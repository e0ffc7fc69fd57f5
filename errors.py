"""The project's bad-input error (library code raises it, command lines print it as one line and exit 2), and the
check every command line makes first: that it runs in a Python that has the project's requirements."""
import importlib.util
import sys

REQUIRED = ("torch", "safetensors", "tokenizers", "gguf", "numpy", "jinja2")  # imported by every command's path


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def check_python() -> None:
    """One line and exit 1 when this Python lacks the requirements (the system Python instead of the project's
    venv), instead of a ModuleNotFoundError traceback from the first import."""
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"error: {', '.join(missing)} not installed in this Python ({sys.executable}): run "
                 "`bash scripts/setup.sh` once, then use .venv/bin/python")

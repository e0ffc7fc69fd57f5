"""The project's two error types (library code raises them; command lines print them as one line, exit 2 for bad
input and 1 for a failed environment) and the check every command line makes first: that it runs in a Python that
has the project's requirements."""
import importlib.util
import os
import re
import sys

REQUIRED = ("torch", "safetensors", "tokenizers", "gguf", "numpy", "jinja2")  # imported by every command's path


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


class EnvironmentFailure(Exception):
    """The environment failed (a full disk, a file size limit, a refused permission) where the library has a better
    line than the OS error's: printed as one line, exit code 1."""


def check_python() -> None:
    """One line and exit 1 when this Python lacks the requirements (the system Python instead of the project's
    venv), instead of a ModuleNotFoundError traceback from the first import; an OMP_NUM_THREADS that is not a thread
    count is one line, exit 2, before torch loads OpenMP. Also: Ctrl-C before the command's own
    handling (cli.run_cli), while torch imports, is the line `interrupted`, not a KeyboardInterrupt traceback (the
    exit status stays the interrupt's)."""
    sys.excepthook = quiet_interrupt
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"error: {', '.join(missing)} not installed in this Python ({sys.executable}): run "
                 "`bash scripts/setup.sh` once, then use .venv/bin/python")
    threads = os.environ.get("OMP_NUM_THREADS")  # libgomp warns about another value and goes on with its default
    if threads is not None and not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", threads):
        print(f"error: OMP_NUM_THREADS={threads!r} is not a number of threads >= 1: unset it or give one such as 4",
              file=sys.stderr)
        sys.exit(2)


def quiet_interrupt(kind, value, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        print("\ninterrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)

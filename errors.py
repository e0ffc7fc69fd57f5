"""The project's two error types (library code raises them; command lines print them as one line, exit 2 for bad
input and 1 for a failed environment) and the check every command line makes first: that it runs in a Python that
has the project's requirements."""
import importlib.util
import sys

REQUIRED = ("torch", "safetensors", "tokenizers", "gguf", "numpy", "jinja2")  # imported by every command's path


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


class EnvironmentFailure(Exception):
    """The environment failed (a full disk, a file size limit, a refused permission) where the library has a better
    line than the OS error's: printed as one line, exit code 1."""


def check_python() -> None:
    """One line and exit 1 when this Python lacks the requirements (the system Python instead of the project's
    venv), instead of a ModuleNotFoundError traceback from the first import. Also: Ctrl-C before the command's own
    handling (cli.run_cli), while torch imports, is the line `interrupted`, not a KeyboardInterrupt traceback (the
    exit status stays the interrupt's)."""
    sys.excepthook = quiet_interrupt
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"error: {', '.join(missing)} not installed in this Python ({sys.executable}): run "
                 "`bash scripts/setup.sh` once, then use .venv/bin/python")


def quiet_interrupt(kind, value, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        print("\ninterrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)

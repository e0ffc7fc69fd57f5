"""The project's two error types (library code raises them; command lines print them as one line, exit 2 for bad
input and 1 for a failed environment) and the check every command line makes first: that it runs in a Python that
has the project's requirements."""
import importlib.util
import math
import numbers
import os
import re
import sys

REQUIRED = ("torch", "safetensors", "tokenizers", "gguf", "numpy", "jinja2")  # imported by every command's path


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


class EnvironmentFailure(Exception):
    """The environment failed (a full disk, a file size limit, a refused permission) where the library has a better
    line than the OS error's: printed as one line, exit code 1."""


def check_int(name: str, value, least: int | None = None, most: int | None = None) -> int:
    """`value` as an integer parameter `name` in [least, most]; a UserError naming it otherwise (a bool is no
    integer). Library errors name parameters as `name` or name=value; a command line shows its flag (cli.py)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise UserError(f"`{name}` must be an integer, got {value!r}")
    if (least is not None and value < least) or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"<= {most}" if least is None else f"between {least} and {most}"
        raise UserError(f"`{name}` must be {bound}, got {value}")
    return int(value)


def check_number(name: str, value, least: float | None = None) -> float:
    """`value` as a finite number parameter `name` (>= least when given); UserError naming it otherwise."""
    bound = f" >= {least:g}" if least is not None else ""
    if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
            or (least is not None and value < least)):
        raise UserError(f"`{name}` must be a finite number{bound}, got {value!r}")
    return float(value)


def check_text(name: str, value, blank_ok: bool = False) -> str:
    """A text parameter: a str, valid Unicode (UTF-8 encodable), not empty, nor blank unless blank_ok; UserError
    naming it."""
    if not isinstance(value, str):
        raise UserError(f"{name}={value!r} is not a text (str)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"`{name}` is not valid Unicode text (a lone surrogate at character {e.start + 1})") from None
    if not value or (not blank_ok and not value.strip()):
        raise UserError(f"`{name}` is empty")
    return value


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

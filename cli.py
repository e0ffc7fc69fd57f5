"""What every command line shares (imported only by command-line entry points, never by library modules): an
argparse whose errors are one line, and run_cli, which turns the project's error types into one line and exit 2."""
import argparse
import sys
from pathlib import Path

from convert import CheckpointError
from errors import UserError
from model import ConfigError


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def check_writable(path: Path, flag: str) -> None:
    """Fail before the work, not after it, when an output file cannot be written (the permission bits alone do not
    tell: root passes them, and /proc refuses anyway)."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None
    if not existed:
        path.unlink()


def run_cli(run_fn, a) -> int:
    """Run a command; bad input of any kind becomes one line on stderr and exit code 2 (shared with scripts/)."""
    from policies import PolicyError
    from tokenizer import TokenizerError
    try:
        return run_fn(a)
    except (UserError, ConfigError, CheckpointError, TokenizerError, PolicyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

"""What the peer scripts share (scripts/bench_kvpress.py in .venv-kv, scripts/bench_llamacpp.py in .venv-llamacpp):
they run in venvs of their own, without the project's modules, so this file imports the standard library only."""
import sys

if __name__ == "__main__":  # run directly: one line, not an ImportError
    PART = "scripts/peer.py is a part of scripts/bench_kvpress.py and scripts/bench_llamacpp.py, not a command"
    print(f"usage: {PART}" if sys.argv[1:] in (["-h"], ["--help"]) else f"error: {PART}",
          file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import argparse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import EnvironmentFailure, UserError  # noqa: E402,F401  (standard library only)
from files import read_json  # noqa: E402,F401  (standard library only)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def reset_peak() -> None:
    """Start a phase: the process's peak RSS (VmHWM) back to its current RSS (the measure bench.py uses)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def os_error_line(e: OSError) -> str:
    """An OS error as one line naming its file: 'error: build/x.gguf: No space left on device'."""
    return f"error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}"

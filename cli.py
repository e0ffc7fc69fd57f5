"""What every command line shares (imported only by command-line entry points, never by library modules): an
argparse whose errors are one line, and run_cli, the one place where a failure becomes what the user reads.

Exit codes (docs/errors.md): 0 done; 2 bad input (a flag, a file or a checkpoint that is wrong: the project's
error types); 1 the environment failed (an OS error such as a full disk or a refused permission, out of memory) or
an internal error (a bug: one line, the traceback in the error log, or printed with -v / BUDGETKV_VERBOSE=1);
130 interrupted; 128 + the signal for SIGTERM (143) and SIGHUP (129). Logs are private to the user (files.open_log)."""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path

from errors import EnvironmentFailure, UserError
from files import STOP_SIGNALS, dies_with_parent, disk_full, log_dir, open_log, stderr_to_log
import ranks
from progress import Ticker


REPO = Path(__file__).resolve().parent


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with the description's lines kept and every flag's default shown: "(default: X)" is appended to a
    flag's help unless it says "default" itself (a switch, None and an empty list show nothing)."""

    def _get_help_string(self, action) -> str:
        text, default = action.help or "", action.default
        if not shows_default(action) or "default" in text.lower():
            return text
        if isinstance(default, Path):
            default = default.relative_to(REPO) if default.is_relative_to(REPO) else default
        shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def shows_default(action) -> bool:
    """Whether a flag's default is a value --help shows: not a switch's, None, or an empty text or list."""
    default = action.default
    return action.nargs != 0 and default is not None and default is not argparse.SUPPRESS and not (
        isinstance(default, str | list | tuple) and not default)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)
        self.add_argument("-v", "--verbose", action="store_true",
                          help="on an internal error print the traceback instead of writing it to "
                               f"{log_dir() / 'error.log'} "
                               "(also BUDGETKV_VERBOSE=1)")

    def parse_known_args(self, args=None, namespace=None):
        a, rest = super().parse_known_args(args, namespace)
        PARSED_SECRETS.extend(v for k, v in vars(a).items() if is_secret(k) and isinstance(v, str))
        return a, rest

    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def is_verbose(a) -> bool:
    return getattr(a, "verbose", False) or os.environ.get("BUDGETKV_VERBOSE") == "1"


@contextmanager
def compile_log(mode: str, compile_prefill: bool, freeze: bool = False, verbose: bool = False):
    """Around --compile's warm-up: inductor's autotune tables and compiler warnings go to a log (-v shows them), and
    the terminal gets one line while it compiles (erased at the end): "compiling the decode step (aot) ... 12 s".
    Yields the terminal's stream (what must not go to the log)."""
    what = ("the prefill and decode steps" if compile_prefill else "the decode step") + (" (frozen)" if freeze else "")
    with stderr_to_log("compile.log", verbose) as terminal, Ticker(f"compiling {what} ({mode})", stream=terminal):
        yield terminal


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def as_flags(message: str, a) -> str:
    """A library error's parameters in this command line's words: `name=value` becomes `--name value` and `name`
    (in backquotes) `--name`, for each name the command line has as a flag (an argparse destination of `a`);
    other backquoted names lose their quotes."""
    names = set(vars(a)) if a is not None else set()

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")
    message = re.sub(r"`([a-z][a-z0-9_]*)`", lambda m: flag(m[1]) if m[1] in names else m[1], message)
    return re.sub(r"(?<![\w.-])([a-z][a-z0-9_]*)=(?=\S)", lambda m: flag(m[1]) + " " if m[1] in names else m[0],
                  message)


def os_error_line(e: OSError) -> str:
    """'<file>: <problem>' from an OSError (e.strerror + e.filename, as the OS reported them)."""
    what = e.strerror or one_line(e)
    files = [str(f) for f in (e.filename, e.filename2) if f is not None]
    return f"{' -> '.join(files)}: {what}" if files else what


def safetensors_os_error(e: Exception) -> OSError | None:
    """safetensors reports a failed read or write (a full disk, a refused permission) as SafetensorError with the OS
    error in its text, without the file: the file is the `filename` that safetensors' Python caller was given."""
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m is None:
        return None
    path = re.search(r'at path "([^"]*)"', str(e))
    filename = path.group(1) if path else None
    for frame, _ in traceback.walk_tb(e.__traceback__):
        if frame.f_globals.get("__name__", "").startswith("safetensors") and "filename" in frame.f_locals:
            filename = str(frame.f_locals["filename"])
    errno = int(m.group(1))
    return OSError(errno, os.strerror(errno), filename)


def full_disk_line(e: OSError) -> str:
    """'<file>: No space left on device (...)', or where no file is known, the folders a compiler writes in that
    have less than 1 MiB free (TMPDIR, TORCHINDUCTOR_CACHE_DIR, BUDGETKV_AOT_DIR)."""
    where = e.filename
    if where is None:
        folders = [tempfile.gettempdir()] + [os.environ[v] for v in ("TORCHINDUCTOR_CACHE_DIR", "BUDGETKV_AOT_DIR")
                                             if os.environ.get(v)]
        where = ", ".join(f for f in folders if free_bytes(f) < 2 ** 20) or f"one of {', '.join(folders)}"
    return (f"{where}: {e.strerror} (free some space, or point TMPDIR and TORCHINDUCTOR_CACHE_DIR at another disk, "
            "then run again)")


def free_bytes(folder: str) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 2 ** 63
    return st.f_bavail * st.f_frsize


PARSED_SECRETS: list[str] = []  # the values of secret flags as parsed (an abbreviation too: --hf-tok X)
SECRET_WORDS = {"token", "secret", "password", "passwd", "credentials", "key", "apikey"}


def is_secret(name: str) -> bool:
    """A flag or variable name whose value is a secret: one of its words (split at - and _) is SECRET_WORDS'
    (--hf-token, HF_TOKEN, --db-password; not --max-new-tokens)."""
    return any(w in SECRET_WORDS for w in re.split(r"[-_]+", name.lower()))


def redacted(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv with each secret value replaced by ***: --hf-token X, --hf-token=X, HF_TOKEN=X; the values replaced)."""
    out, values = list(argv), []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if eq and is_secret(name.lstrip("-")):
            out[i] = f"{name}=***"
        elif arg.startswith("-") and not eq and is_secret(arg.lstrip("-")) and i + 1 < len(argv):
            out[i + 1] = "***"
            value = argv[i + 1]
        else:
            continue
        values.append(value)
    return out, values


def redact(argv: list[str], text: str) -> str:
    """The command line (secrets redacted) and `text`, in which every secret of the command line and of the
    environment (a variable named as is_secret says) long enough not to be an ordinary word is replaced by ***."""
    return scrub(" ".join(redacted(argv)[0]) + "\n" + text, argv)


def scrub(text: str, argv: list[str] | None = None) -> str:
    """text with every secret of the command line (argv, default sys.argv) and of the environment replaced by ***
    (values of 8 characters or more)."""
    values = redacted(sys.argv if argv is None else argv)[1] + PARSED_SECRETS
    values += [v for k, v in os.environ.items() if is_secret(k)]
    for value in sorted((v for v in values if len(v) >= 8), key=len, reverse=True):
        text = text.replace(value, "***")
    return text


def internal_error(e: BaseException, verbose: bool) -> int:
    """A bug: one line plus where the traceback is (the error log, headed by the command line, secrets redacted), or
    the traceback itself with -v."""
    if verbose:
        print(scrub("".join(traceback.format_exception(e))), end="", file=sys.stderr)
        return 1
    try:
        fd, log, note = open_log("error.log")
        with open(fd, "w") as f:
            f.write(redact(sys.argv, "".join(traceback.format_exception(e))))
        where = f"traceback in {log}{f' ({note})' if note else ''}; or rerun with -v"
    except OSError as log_error:
        where = f"could not write the traceback to {log_dir() / 'error.log'} ({log_error.strerror}); rerun with -v"
    print(f"internal error: {type(e).__name__}: {scrub(one_line(e))} ({where})", file=sys.stderr)
    return 1


def run_ranks(run_fn, parse_args) -> int:
    """A command line that may run under torchrun (ranks.py): only rank 0 prints, a lost rank is one line naming it,
    bad input is one line and exit 2 on rank 0 alone (ranks.exit_code), and the group is left at the end."""
    ranks.quiet_other_ranks()
    try:
        try:
            a = parse_args()
        except SystemExit as e:  # argparse's one line (Parser), or --help
            if not isinstance(e.code, int):
                raise
            return ranks.exit_code(e.code)
        return ranks.exit_code(run_cli(ranks.naming_lost_ranks(run_fn), a))
    finally:
        ranks.finish()


class Terminated(BaseException):
    """SIGTERM or SIGHUP (args[0]: the signal), raised where the main thread is, so that `finally` blocks and
    context managers run (temporary files and folders removed, child processes stopped). Not an Exception: no
    `except Exception` swallows it."""


def raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def terminated_raises():
    """SIGTERM and SIGHUP raise Terminated inside the block (in the main thread; elsewhere nothing changes), and
    their handlers are restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def start_child(cmd: list[str], **kw) -> subprocess.Popen:
    """A child process of a command line: stopped with it (dies_with_parent); stop it with stop_child. The stop
    signals wait while it forks (files.STOP_SIGNALS)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def in_child():
        dies_with_parent()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    try:
        return subprocess.Popen(cmd, preexec_fn=in_child, **kw)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stop_child(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM (its cleanup runs), then SIGKILL if it is still there after grace_s."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_child(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, **kw) for a command line: the child is stopped
    (stop_child) when this process stops waiting for it early, for any reason (an error, Ctrl-C, Terminated), and
    dies with this process if it is killed."""
    with start_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as p:
        try:
            out, err = p.communicate()
        except BaseException:
            stop_child(p)
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_cli(run_fn, a) -> int:
    """Run a command; every failure becomes one line on stderr (the exit codes are in this module's docstring), and
    SIGTERM and SIGHUP end it through its `finally` blocks (Terminated), with the line `terminated`. Shared by every
    entry point (generate.py and scripts/)."""
    from safetensors import SafetensorError
    verbose = is_verbose(a)
    if sys.stdout is None:  # started with stdout closed (>&-): print() would fail on None
        print("error: standard output is closed: give it a file or /dev/null", file=sys.stderr)
        return 1
    try:
        with terminated_raises():
            return run_fn(a)
    except Terminated as e:
        try:
            print("terminated", file=sys.stderr)
        except OSError:  # SIGHUP: the terminal may be gone
            pass
        return 128 + e.args[0]
    except (UserError, EnvironmentFailure) as e:
        print(f"error: {scrub(as_flags(one_line(e), a))}", file=sys.stderr)
        return 1 if isinstance(e, EnvironmentFailure) else 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): nothing more can be shown there
        try:  # else Python's exit flushes into the closed pipe and prints a second error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        print("error: output closed early (broken pipe)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {scrub(os_error_line(e))}", file=sys.stderr)
        return 1
    except MemoryError:
        print("error: out of memory (MemoryError)", file=sys.stderr)
        return 1
    except Exception as e:
        import torch
        if isinstance(e, torch.OutOfMemoryError):
            print(f"error: out of device memory: {one_line(e).split('. ')[0]}", file=sys.stderr)
            return 1
        io = safetensors_os_error(e) if isinstance(e, SafetensorError) else None
        if io is not None:
            print(f"error: {os_error_line(io)}", file=sys.stderr)
            return 1
        full = disk_full(e)
        if full is not None:  # a compiler's files (TMPDIR, the inductor cache) on a full disk, among others
            print(f"error: {full_disk_line(full)}", file=sys.stderr)
            return 1
        if isinstance(e, SafetensorError):  # a malformed file that no library caller caught: bad input
            print(f"error: cannot read a safetensors file (truncated or corrupt?): {one_line(e)}", file=sys.stderr)
            return 2
        return internal_error(e, verbose)

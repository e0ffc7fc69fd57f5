"""Files that are never half-written: each write goes to a temporary name beside its target (.budgetkv-tmp-<pid>-
<name>), is given the permissions of the file it replaces (else the umask's: safetensors creates 0600), fsynced and
renamed into place, and the folder fsynced, so a reader sees the old file or the whole new one. A killed run's
temporary files are removed by the next run that writes into the same folder (their process is gone). A failed
write is one line (EnvironmentFailure, exit 1) naming the file. Logs are opened in one place, open_log: private to
the user, never through a link."""
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from errors import EnvironmentFailure, UserError

TMP_PREFIX = ".budgetkv-tmp-"  # + "<pid>-<name>": removed by the next run once that process is gone


LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1


# Held (pending) while a process forks: os.fork() runs Python hooks in the parent (logging's, which release its
# lock), and a stop signal's exception raised inside one is only printed, the signal lost and the lock kept.
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def dies_with_parent() -> None:
    """In a child process (a preexec_fn, or a fork's first step): on Linux it gets SIGTERM when the process that
    started it ends, however it ends (SIGKILL included), and runs its own cleanup: no child outlives its run. The
    kernel watches the thread that started the child: start children from a thread that outlives them (the main
    one)."""
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale_tmp(folder: Path) -> None:
    """Remove the temporary files (and staging folders) that a killed run left in `folder`: ours are named
    .budgetkv-tmp-<pid>-<name>, and a pid that is not alive will never finish them. Also the old `budgetkv.tmp`."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for p in entries:
        pid = p.name[len(TMP_PREFIX):].split("-", 1)[0] if p.name.startswith(TMP_PREFIX) else ""
        if (pid.isdigit() and not pid_alive(int(pid))) or p.name == "budgetkv.tmp":
            try:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            except OSError:
                pass  # a read-only folder: nothing we could write there either


def regular_file(path: Path) -> bool:
    """Whether a checkpoint's optional file is there: True for a regular file, False when nothing is there; anything
    else (a pipe, a device, a folder, a dangling link) is refused, never read (a pipe would block) nor taken as
    absent."""
    if path.is_file():
        return True
    if path.exists() or path.is_symlink():
        raise UserError(f"{path} is not a regular file")
    return False


def unreachable(path: Path) -> str | None:
    """Why `path` cannot be reached, for an error line (None when it can): a symlink loop named as such, where
    Path.exists() says only False."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop (too many levels of symbolic links)"
        return "no such file or directory" if e.errno == errno.ENOENT else (e.strerror or str(e))
    except ValueError:  # a NUL byte in the path
        return "not a valid path"
    return None


def log_dir() -> Path:
    """Where the logs go: a folder of this user's in the temporary folder, $TMPDIR/budgetkv-<uid>."""
    return Path(tempfile.gettempdir()) / f"budgetkv-{os.getuid()}"


def not_private(folder: Path) -> str | None:
    """Why `folder` is not a folder only this user can enter (None when it is); made (0700) when missing. lstat: a
    link is not followed."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid != os.getuid():
        return f"{folder} is another user's"
    if st.st_mode & 0o077:
        return f"{folder} is open to others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def open_private(path: Path) -> int:
    """`path` opened for writing, emptied, mode 0600: only a regular file, never through a link (O_NOFOLLOW), never
    waiting on a named pipe."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.ftruncate(fd, 0)
        os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_log(name: str) -> tuple[int, Path, str | None]:
    """The one place logs are opened: log_dir()/name, for writing, private to this user (the folder 0700 and this
    user's, the file 0600 and not a link). Where that cannot be (the folder or the file is a link, a folder, another
    user's), a new file of a unique name in the temporary folder instead (budgetkv-<name>-XXXXXXXX.log, 0600).
    Returns (fd, path, note): note says why the usual path was not used (None when it was). OSError when neither
    can be opened."""
    path = log_dir() / name
    try:
        problem = not_private(path.parent)
        if problem is None:
            return open_private(path), path, None
    except OSError as e:
        problem = "a symbolic link" if e.errno == errno.ELOOP else e.strerror or str(e)
    fd, other = tempfile.mkstemp(prefix=f"budgetkv-{Path(name).stem}-", suffix=".log")
    return fd, Path(other), f"cannot use {path}: {problem}"


@contextmanager
def stderr_to_log(name: str, verbose: bool):
    """Send file descriptor 2 (torch.compile's autotune tables, the C++ compiler's and Python's warnings) to the log
    `name` (files.open_log) for the block, and yield a text stream on the terminal's own stderr, for a progress line.
    verbose, or a log that cannot be opened: stderr stays as it is; a log opened elsewhere than usual is named."""
    sys.stderr.flush()
    try:
        if verbose:
            raise OSError
        log_fd, log, note = open_log(name)
    except OSError:
        yield sys.stderr
        return
    if note:
        print(f"note: {note}: this log is {log}", file=sys.stderr)
    saved, saved_stream = os.dup(2), sys.stderr
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stderr = open(os.dup(2), "w")  # Python's own writes too, where sys.stderr is not fd 2
    try:
        with open(os.dup(saved), "w") as terminal:
            yield terminal
    finally:
        sys.stderr.close()
        sys.stderr = saved_stream
        os.dup2(saved, 2)
        os.close(saved)


def read_capped(path: Path, limit: int) -> bytes:
    """The first limit + 1 bytes of `path` (more than `limit` means too large: /dev/zero never ends). A named pipe
    is opened without waiting for a writer, so one that nobody writes to reads as empty instead of blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


JSON_MAX_BYTES = 64 << 20  # a config, tokenizer, manifest or resume file; tokenizer.json files are under 40 MiB
JSON_MAX_DEPTH = 64  # nesting: config and tokenizer files nest under 10 levels


def parse_json(text: str | bytes):
    """json.loads, nested at most JSON_MAX_DEPTH levels: a ValueError otherwise (never a RecursionError). Every file
    a user or another tool wrote is parsed here (read_json)."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    else:
        level = [value] if isinstance(value, dict | list) else []
        for _ in range(JSON_MAX_DEPTH):  # level: the containers at one depth
            level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, dict | list)]
        if not level:
            return value
    raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels")


def read_json(path: Path, limit: int = JSON_MAX_BYTES):
    """The JSON value in the file `path`, read with bounds: at most `limit` bytes (/dev/zero never ends), UTF-8,
    nested at most JSON_MAX_DEPTH levels. ValueError (the reason; the caller names the file) or OSError."""
    data = read_capped(path, limit)
    if len(data) > limit:
        raise ValueError(f"larger than {limit >> 20} MiB")
    return parse_json(data.decode("utf-8"))


def check_writable(path: Path, what: str) -> None:
    """Fail before the work, not after it, when an output file cannot be written (the permission bits alone do not
    tell: root passes them, and /proc refuses anyway). The output is renamed into place: only a regular file is
    replaced. what: how the error line names it (a command line's flag)."""
    existed = path.exists()
    if existed and not path.is_file() and not path.is_dir():  # a pipe would block the open, a device be replaced
        raise UserError(f"{what} {path}: cannot write there (not a regular file: the output replaces what is there)")
    try:
        if path.is_symlink():  # the output replaces the link: never open (or create) what it points to
            with tempfile.TemporaryFile(dir=path.parent):
                return
        with open(path, "a"):
            pass
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UserError(f"{what} {path}: cannot write there ({getattr(e, 'strerror', None) or e})") from None
    if not existed:
        path.unlink()


def check_out_dir(path: Path, what: str) -> None:
    """An output directory: a directory or nothing yet, under a folder this process can write in. Creates nothing.
    what: how the error line names it (a command line's flag)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"cannot create {what} {path}: a file of that name exists")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot create {what} {path}: {parent} is a file")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise UserError(f"cannot create {what} {path}: {parent} is not writable ({e.strerror or e})") from None


def tmp_path(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(path: Path, e: BaseException) -> EnvironmentFailure:
    """One line for a failed write: the file and the reason (a full disk, a file size limit, permissions).
    safetensors reports an OS error as text ("... File too large (os error 27)")."""
    found = re.search(r"os error (\d+)", str(e))
    code = e.errno if isinstance(e, OSError) else int(found.group(1)) if found else None
    reason = os.strerror(code) if code else " ".join(str(e).split()) or type(e).__name__
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        reason += " (free some space or raise the file size limit, then run again)"
    return EnvironmentFailure(f"cannot write {path}: {reason}")


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit


def disk_full(e: BaseException) -> OSError | None:
    """The full disk (FULL) that made `e` fail, where another error carries it: an OSError among its causes (inductor
    writing its cache), or the line a compiler wrote into its text ("error closing /tmp/ccX.s: No space left on
    device"), with the file where known; None for any other failure."""
    cause = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in FULL:
            return cause
        cause = cause.__cause__ or cause.__context__
    for code in FULL:
        found = re.search(rf"(?:(/\S+): )?{re.escape(os.strerror(code))}", str(e))
        if found:
            return OSError(code, os.strerror(code), found.group(1))
    return None


def file_mode(path: Path) -> int:
    """The permission bits a file written as `path` gets: those of the file it replaces, else 0666 less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def claim(tmp: Path) -> None:
    """Make the temporary name `tmp` a new empty file of ours before anything writes it: the name is predictable,
    and a link planted there would have the write (and the chmod) go through it to the link's target. Our own
    leftover (a pid reused) is removed; another user's entry in a sticky folder cannot be, and the write fails."""
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))


def write_atomic(path: Path, write) -> None:
    """write(tmp) writes the content to a temporary name beside `path` (claimed first); it is then fsynced and
    renamed into place, and the folder fsynced: `path` is the old file or the whole new one, never a part. Errors ->
    EnvironmentFailure."""
    from safetensors import SafetensorError
    tmp, claimed = tmp_path(path), False
    try:
        claim(tmp)
        claimed = True
        write(tmp)
        os.chmod(tmp, file_mode(path))
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except (OSError, SafetensorError) as e:
        if claimed:
            tmp.unlink(missing_ok=True)
        raise write_error(path, e) from None
    except BaseException:
        if claimed:
            tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def jsonl_objects(path: Path, text: str, what: str = "a row", limit: int | None = None) -> list[dict]:
    """The first `limit` JSON objects of a .jsonl text (blank lines skipped), each with its line number as "_line";
    ValueError naming the line for one that is not JSON or not an object (`what` names what a line holds)."""
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = parse_json(line)
        except ValueError as e:
            raise ValueError(f"{path} line {n} is not JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {n}: {what} is a JSON object, not {json_type(row)}")
        rows.append(row | {"_line": n})
    return rows


def json_type(v) -> str:
    return {str: "a string", list: "a list", dict: "an object", bool: "true/false", type(None): "null"}.get(
        type(v), "a number")


def export_trace(prof, path: Path) -> None:
    """The profiler's chrome trace, written whole or not at all. torch's exporter writes <name>.tmp and renames it
    over its target, and reports a failed write only in a log line: it writes a temporary file of ours here, which
    must then exist, and that file replaces `path`."""
    tmp = tmp_path(path)
    try:
        for name in (tmp, tmp.with_name(tmp.name + ".tmp")):  # no planted link to write through
            claim(name)
        prof.export_chrome_trace(str(tmp))
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise EnvironmentFailure(f"cannot write {path}: the profiler could not write its trace (a full disk or a "
                                     "file size limit?)")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".tmp").unlink(missing_ok=True)

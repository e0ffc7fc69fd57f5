"""Outputs that survive interruption (scripts/eval.py, scripts/bench.py): a file is replaced atomically (a reader
sees the old one or the whole new one, never a part), a journal gets one whole JSON line per finished configuration,
and `settings` (what a run's results depend on) are recorded beside the results, so that --resume reuses results
only from a run with the same settings and refuses to mix in any other."""
import sys

if __name__ == "__main__":  # run directly: one line, not an ImportError
    PART = "scripts/outputs.py is a part of scripts/eval.py and the benchmarks, not a command of its own"
    print(f"usage: {PART}" if sys.argv[1:] in (["-h"], ["--help"]) else f"error: {PART}",
          file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import hashlib
import io
import json
import os
from pathlib import Path

import files
from errors import UserError
from files import remove_stale_tmp


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` by `data`, never leaving a part of it (files.write_atomic)."""
    remove_stale_tmp(path.parent)
    files.write_atomic(path, lambda tmp: tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data))


def append_line(path: Path, obj) -> None:
    """Append obj as one JSON line, fsynced. A line cut short (killed mid-write, disk full) lacks its newline, which
    is how read_lines tells it apart and drops it."""
    try:  # never through a link planted at the journal's name after its first (atomic) write
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if os.fstat(fd).st_nlink != 1:  # nor into another file through a hard link planted there
            os.close(fd)
            raise UserError(f"{path} has other hard links: a journal is appended to only as a file of its own "
                            "(move it away to start a new one)")
        with open(fd, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a write's error names no file: name it (a full disk, a file size limit)
        raise OSError(e.errno, e.strerror, str(path)) from None


def save_png(fig, path: Path, dpi: int = 100) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    write_atomic(path, buf.getvalue())


def checksum(entry: dict) -> str:
    """The digest of an output entry's content, its own "sum" left out: what --resume checks a kept entry against."""
    return digest({k: v for k, v in entry.items() if k != "sum"})


def digest(obj) -> str:
    """A short content hash of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_identity(ckpt: Path) -> dict:
    """What tells this checkpoint from another without reading its weights: its folder, its config.json's content,
    its tokenizer files' content (they make the prompts' ids) and the size and modification time of each weights
    file (a re-converted or replaced checkpoint differs)."""
    from convert import TOKENIZER_FILES
    config, tok = ckpt / "config.json", hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (ckpt / name).is_file():
            with open(ckpt / name, "rb") as f:
                tok.update(f"{name}\0{hashlib.file_digest(f, 'sha256').hexdigest()}\0".encode())
    return {"path": str(ckpt.resolve()), "config": hashlib.sha256(config.read_bytes()).hexdigest()[:16],
            "tokenizer": tok.hexdigest()[:16],
            "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(ckpt.glob("*.safetensors"))]}


def first_difference(old: dict, new: dict) -> str | None:
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            return f"{k}: {json.dumps(old.get(k))} there, {json.dumps(new.get(k))} now"
    return None


def check_settings(path: Path, old, new: dict) -> None:
    """--resume: refuse (one line) an output that a run with other settings wrote."""
    if not isinstance(old, dict):
        raise UserError(f"--resume: {path} records no settings: not written by this script (run without --resume "
                        "to replace it)")
    why = first_difference(old, new)
    if why is not None:
        raise UserError(f"--resume: {path} was written by a run with other settings ({why}); run without --resume "
                        "to replace it, or write elsewhere")


def read_lines(path: Path) -> list[tuple[int, object]]:
    """A journal's whole lines as (line number, parsed JSON). The part after the last newline (a line cut short) is
    dropped; anything else unreadable is refused in one line."""
    data = files.read_capped(path, files.JSON_MAX_BYTES)  # a sparse file may say it is terabytes
    if len(data) > files.JSON_MAX_BYTES:
        raise UserError(f"--resume: {path} is larger than {files.JSON_MAX_BYTES >> 20} MiB: not written by this script "
                        "(run without --resume to replace it)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--resume: {path} is not UTF-8 text: not written by this script (run without --resume to "
                        "replace it)") from None
    out = []
    for n, line in enumerate(text.split("\n")[:-1], 1):
        try:
            out.append((n, files.parse_json(line)))
        except ValueError as e:
            raise UserError(f"--resume: {path} line {n} is not JSON ({getattr(e, 'msg', e)}): not written by this "
                            "script (run without --resume to replace it)") from None
    return out


def read_json(path: Path):
    """--resume: the JSON output a previous run left at `path` (None when there is none)."""
    if not path.exists():
        return None
    try:
        return files.read_json(path)
    except ValueError as e:
        raise UserError(f"--resume: {path} is not JSON ({e}): not written by this script (run without --resume to "
                        "replace it)") from None

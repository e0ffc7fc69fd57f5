"""Converted and quantized checkpoints never serve stale weights (docs/checkpoints.md): a same-size change of a
GGUF or of an HF folder's safetensors is converted again with one line saying so; a conversion or quantization
killed (SIGKILL from the test) or run out of disk space (RLIMIT_FSIZE in a child) leaves the old complete state or
nothing a later run trusts, and its temporary files are removed by the next run; GGUF metadata is checked by type
and range with the field's name. Tiny models only, no torch.compile."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoint
import convert
from convert import ENGINE_FILE, CheckpointError
from files import TMP_PREFIX
from errors import UserError

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from test_gguf_convert import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def ckpts(tmp_path, monkeypatch):
    """checkpoints/ in tmp_path, for this process and for the children (BUDGETKV_CHECKPOINTS)."""
    d = tmp_path / "ckpts"
    monkeypatch.setattr(checkpoint, "CHECKPOINTS", d)
    return d


def gguf_pair(tmp_path):
    """Two GGUFs of the same byte size, different weights and context length (so config.json differs too)."""
    a = write_tiny_llama(tmp_path / "a.gguf", seed=0, meta={"context_length": 2048})
    b = write_tiny_llama(tmp_path / "b.gguf", seed=1, meta={"context_length": 4096})
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    return a, b


def overwrite_in_place(path: Path, data: bytes, keep_mtime: bool = False) -> None:
    """Same file, same inode and size, new content; optionally with its old mtime put back (os.utime)."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino


def gguf_embedding(path: Path) -> torch.Tensor:
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    return torch.from_numpy(np.array(t.data, dtype=np.float32))


def served(ckpt: Path, name="tok_embeddings.weight") -> torch.Tensor:
    """What loading.load_model loads for `name` (it reads the engine file whenever there is one)."""
    from loading import load_model
    return dict(load_model(ckpt, torch.float32, "cpu").state_dict())[name]


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX) or p.suffix == ".tmp")


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------ (a) a GGUF changes

@pytest.mark.parametrize("keep_mtime", [False, True], ids=["plain", "mtime-restored"])
def test_same_size_gguf_change_is_converted_again(tmp_path, ckpts, capsys, monkeypatch, keep_mtime):
    monkeypatch.setattr(convert, "RACY_NS", 0)  # let the stat cache record these just-written files
    a, b = gguf_pair(tmp_path)
    path = shutil.copy(a, tmp_path / "m.gguf")
    path = Path(path)
    out = checkpoint.resolve_checkpoint(str(path))
    assert out == checkpoint.gguf_folder(path) and out.parent == ckpts and out.name.startswith("m-")
    assert one_line(capsys.readouterr().err) == f"converting {path} -> {out} (once)"
    torch.testing.assert_close(served(out), gguf_embedding(a))

    hashed = []
    real_hash = convert.hash_file
    monkeypatch.setattr(convert, "hash_file", lambda f: hashed.append(str(f)) or real_hash(f))
    assert checkpoint.resolve_checkpoint(str(path)) == out and capsys.readouterr().err == ""
    assert hashed == []  # unchanged stat: nothing re-read

    overwrite_in_place(path, b.read_bytes(), keep_mtime)
    assert checkpoint.resolve_checkpoint(str(path)) == out
    assert one_line(capsys.readouterr().err) == f"{path} changed since it was converted: converting again"
    torch.testing.assert_close(served(out), gguf_embedding(b))
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 4096
    assert str(path) in hashed
    # the converted folder given by path is checked against its GGUF too
    overwrite_in_place(path, a.read_bytes(), keep_mtime)
    assert checkpoint.resolve_checkpoint(str(out)) == out
    assert "changed since it was converted: converting again" in one_line(capsys.readouterr().err)
    torch.testing.assert_close(served(out), gguf_embedding(a))
    assert checkpoint.resolve_checkpoint(str(out)) == out and capsys.readouterr().err == ""


def test_an_older_engine_file_without_identity_is_converted_again(tmp_path, ckpts, capsys):
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    capsys.readouterr()
    save_file(load_file(str(out / ENGINE_FILE)), str(out / ENGINE_FILE), metadata={"format": "budgetkv"})
    checkpoint.resolve_checkpoint(str(path))
    assert one_line(capsys.readouterr().err) == (f"converting {path} -> {out} again: {out / ENGINE_FILE} records "
                                                 "no source identity (an older budgetkv's, or damaged)")
    assert convert.read_identity(out / ENGINE_FILE)["converter"] == convert.CONVERTER


def test_older_folders_given_by_path_are_redone_from_their_source(tmp_path, ckpts, hf_tiny, capsys):
    """Without an identity: a GGUF conversion whose config.json names its GGUF (as budgetkv 2 wrote it), a
    quantization whose config.json names its source, an HF folder's damaged engine file: each is redone once."""
    import quantize
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    q = tmp_path / "q"
    quantize.quantize_dir(out, "int8", out=q)
    for d in (out, q):
        save_file(load_file(str(d / ENGINE_FILE)), str(d / ENGINE_FILE), metadata={"format": "budgetkv"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"gguf_source": {"path": str(path), "bytes": 1}}))
    capsys.readouterr()
    checkpoint.resolve_checkpoint(str(out))
    assert one_line(capsys.readouterr().err) == (f"converting {path} -> {out} again: {out / ENGINE_FILE} records "
                                                 "no source identity (an older budgetkv's, or damaged)")
    checkpoint.resolve_checkpoint(str(q))
    assert one_line(capsys.readouterr().err) == (f"quantizing {out} -> {q} again: {q / ENGINE_FILE} records no "
                                                 "source identity (an older budgetkv's)")
    assert convert.read_identity(q / ENGINE_FILE)["kind"] == "quantized"
    assert checkpoint.resolve_checkpoint(str(q)) == q and capsys.readouterr().err == ""

    _, src = hf_tiny("llama")
    d = Path(shutil.copytree(src, tmp_path / "hf"))
    convert.convert_hf_dir(d)
    (d / ENGINE_FILE).write_bytes((d / ENGINE_FILE).read_bytes()[:1000])
    capsys.readouterr()
    checkpoint.resolve_checkpoint(str(d))
    assert one_line(capsys.readouterr().err) == (f"converting {d} again: {d / ENGINE_FILE} records no source "
                                                 "identity (an older budgetkv's, or damaged)")
    torch.testing.assert_close(served(d), load_file(str(d / "model.safetensors"))["model.embed_tokens.weight"])


def test_a_hand_edited_config_of_a_conversion_is_redone(tmp_path, ckpts, capsys):
    """config.json is written with the engine file: a config that no longer matches it is not trusted."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    capsys.readouterr()
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    checkpoint.resolve_checkpoint(str(path))
    assert one_line(capsys.readouterr().err) == (f"{out / 'config.json'} changed since it was written with "
                                                 f"{out / ENGINE_FILE}: converting again")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_conversion_whose_source_is_gone_stands_alone(tmp_path, ckpts, capsys):
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    path.unlink()
    assert checkpoint.resolve_checkpoint(str(out)) == out  # nothing to compare the weights with: trusted
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer.json changed since it was written with .*, and its "
                                              r"source .*m.gguf is gone: convert or quantize it again"):
        checkpoint.resolve_checkpoint(str(out))


def test_files_of_the_same_name_convert_into_folders_of_their_own(tmp_path, ckpts, capsys):
    """Two GGUFs both named model.gguf: each converts once into its own folder (run A, B, A: no conversion on the
    third run, no file named as changed), each serves its own weights, and the converter's command line writes
    where the resolver looks."""
    a, b = gguf_pair(tmp_path)
    paths = []
    for d, src in (("x", a), ("y", b)):
        (tmp_path / d).mkdir()
        paths.append(Path(shutil.copy(src, tmp_path / d / "model.gguf")))
    outs = {}
    for path, src in zip(paths + paths[:1], (a, b, a)):
        out = checkpoint.resolve_checkpoint(str(path))
        err = capsys.readouterr().err
        assert err == ("" if path in outs else f"converting {path} -> {out} (once)\n"), err
        outs[path] = out
        torch.testing.assert_close(served(out), gguf_embedding(src))
    assert len(set(outs.values())) == 2 and all(o.parent == ckpts and o.name.startswith("model-") for o in outs.values())

    from scripts import convert_hf_checkpoint
    c = Path(shutil.copy(b, tmp_path / "c.gguf"))
    assert convert_hf_checkpoint.main(["--checkpoint", str(c)]) == 0
    assert checkpoint.resolve_checkpoint(str(c)) == checkpoint.gguf_folder(c)
    assert capsys.readouterr().err == ""  # converted where the resolver looks: not converted again


def test_a_file_named_like_the_embedded_model_never_shares_its_folder(tmp_path, ckpts, capsys, monkeypatch):
    """A user's smollm2-135m.gguf and the embedded smollm2-135m (here a tiny stand-in) convert into folders of
    their own; a folder holding another file's conversion (an older budgetkv converted the user's file into the
    embedded model's folder) is converted again, saying whose conversion it held, never served."""
    a, b = gguf_pair(tmp_path)
    (tmp_path / "wheel").mkdir()
    embedded = Path(shutil.copy(a, tmp_path / "wheel" / checkpoint.EMBEDDED_GGUF[1]))
    monkeypatch.setattr(checkpoint, "embedded_gguf", lambda: embedded)
    user = Path(shutil.copy(b, tmp_path / "smollm2-135m.gguf"))
    for _ in range(2):
        assert checkpoint.resolve_checkpoint("smollm2-135m") == ckpts / "smollm2-135m"
        torch.testing.assert_close(served(ckpts / "smollm2-135m"), gguf_embedding(a))
        out = checkpoint.resolve_checkpoint(str(user))
        assert out != ckpts / "smollm2-135m"
        torch.testing.assert_close(served(out), gguf_embedding(b))
    assert capsys.readouterr().err.count("(once)") == 2  # once each

    convert.convert_gguf(user, ckpts / "smollm2-135m")
    assert checkpoint.resolve_checkpoint("smollm2-135m") == ckpts / "smollm2-135m"
    assert one_line(capsys.readouterr().err) == (f"converting {embedded} -> {ckpts / 'smollm2-135m'} again: it holds "
                                                 f"the conversion of {user}")
    torch.testing.assert_close(served(ckpts / "smollm2-135m"), gguf_embedding(a))


# ---------------------------------------------------------------------------- (b) an HF folder changes

def changed_weights(src: Path) -> dict:
    tensors = load_file(str(src / "model.safetensors"))
    return {k: v + 1.0 if k == "model.embed_tokens.weight" else v for k, v in tensors.items()}


@pytest.mark.parametrize("how", ["path", "short-name"])
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["plain", "mtime-restored"])
def test_same_size_hf_change_is_converted_again(hf_tiny, tmp_path, ckpts, capsys, monkeypatch, how, keep_mtime):
    _, src = hf_tiny("llama")
    capsys.readouterr()  # transformers' progress bars, when the fixture writes the model
    if how == "path":
        d = Path(shutil.copytree(src, tmp_path / "hf"))
        convert.convert_hf_dir(d)  # what scripts/convert_hf_checkpoint.py does
        name = str(d)
    else:
        monkeypatch.setitem(checkpoint.MODELS, "tiny", "acme/tiny")
        d = Path(shutil.copytree(src, ckpts / "acme" / "tiny"))
        name = "tiny"
        assert checkpoint.resolve_checkpoint(name) == d
        assert one_line(capsys.readouterr().err) == f"converting {d} (once)"
    assert checkpoint.resolve_checkpoint(name) == d and capsys.readouterr().err == ""
    old = served(d)

    new = changed_weights(d)
    tmp = tmp_path / "new.safetensors"
    save_file(new, str(tmp), metadata={"format": "pt"})
    overwrite_in_place(d / "model.safetensors", tmp.read_bytes(), keep_mtime)
    assert checkpoint.resolve_checkpoint(name) == d
    line = one_line(capsys.readouterr().err)
    assert line == f"{d / 'model.safetensors'} changed since it was converted: converting again"
    torch.testing.assert_close(served(d), new["model.embed_tokens.weight"])
    assert not torch.equal(served(d), old)


def test_a_shard_added_to_an_hf_folder_is_seen(hf_tiny, tmp_path, capsys):
    _, src = hf_tiny("llama")
    d = Path(shutil.copytree(src, tmp_path / "hf"))
    convert.convert_hf_dir(d)
    tensors = load_file(str(d / "model.safetensors"))
    head = {"lm_head.weight": tensors.pop("lm_head.weight") * 2}
    save_file(tensors, str(d / "model.safetensors"))
    save_file(head, str(d / "model-2.safetensors"))
    checkpoint.resolve_checkpoint(str(d))
    assert "model-2.safetensors changed since it was converted: converting again" in capsys.readouterr().err
    torch.testing.assert_close(served(d, "output.weight"), head["lm_head.weight"])


# ------------------------------------------------------------------ (c) SIGKILL, (d) a full disk: children

CHILD_STOP = """
import os, pathlib, sys, time
real = os.replace
def replace(src, dst, *a, **k):  # stop just before `dst` is renamed into place, and wait for the SIGKILL
    if pathlib.Path(dst).name == os.environ["STOP_AT"]:
        pathlib.Path(os.environ["READY"]).write_text(str(os.getpid()))
        time.sleep(600)
    return real(src, dst, *a, **k)
os.replace = replace
sys.argv = sys.argv[1:]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""

CHILD_FSIZE = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def child_env(ckpts: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETKV")}
    return env | {"BUDGETKV_CHECKPOINTS": str(ckpts), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                  "PYTHONPATH": str(REPO)} | extra


def kill_at(stop_at: str, ckpts: Path, tmp_path: Path, *argv: str) -> None:
    """Run a command line (script + args) in a child that stops just before renaming `stop_at` into place;
    SIGKILL it there."""
    ready = tmp_path / f"ready-{stop_at}"
    ready.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD_STOP, *argv], cwd=REPO, stderr=subprocess.PIPE,
                             env=child_env(ckpts, STOP_AT=stop_at, READY=str(ready)))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never reached " + stop_at
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


def run_with_fsize(limit: int, ckpts: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD_FSIZE, str(limit), *argv], cwd=REPO, env=child_env(ckpts),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stop_at", ["tokenizer.json", ENGINE_FILE], ids=["in-tokenizer", "before-engine"])
def test_killed_reconversion_is_never_trusted(tmp_path, ckpts, capsys, stop_at):
    """A converted GGUF is replaced by another; the re-conversion is SIGKILLed at `stop_at` (config.json and the
    tokenizer already new, the engine file old). The next run converts again and serves the new weights; a copy of
    the killed folder, given by path with the old GGUF put back, serves the old weights with the old config (converted
    again where config.json was already new). The killed run's temporary files are removed."""
    a, b = gguf_pair(tmp_path)
    path = Path(shutil.copy(a, tmp_path / "m.gguf"))
    out = checkpoint.resolve_checkpoint(str(path))
    overwrite_in_place(path, b.read_bytes())
    kill_at(stop_at, ckpts, tmp_path, "scripts/quantize.py", "--checkpoint", str(path), "--mode", "int8")
    assert temp_files(out), "the kill left no temporary file: it did not stop mid-conversion"
    killed = Path(shutil.copytree(out, tmp_path / "killed"))
    capsys.readouterr()
    for d, source, ctx in ((out, b, 4096), (killed, a, 2048)):
        overwrite_in_place(path, source.read_bytes())
        assert checkpoint.resolve_checkpoint(str(path if d == out else d)) == d
        err = capsys.readouterr().err
        if d == out or stop_at == ENGINE_FILE:  # killed in the tokenizer, the copy is still all A: used as it is
            assert one_line(err).endswith(": converting again")
        else:
            assert err == ""
        torch.testing.assert_close(served(d), gguf_embedding(source))
        assert json.loads((d / "config.json").read_text())["max_position_embeddings"] == ctx
        assert temp_files(d) == []


def test_killed_first_conversion_leaves_nothing_trusted(tmp_path, ckpts, capsys):
    path = write_tiny_llama(tmp_path / "m.gguf")
    kill_at(ENGINE_FILE, ckpts, tmp_path, "scripts/quantize.py", "--checkpoint", str(path), "--mode", "int8")
    out = checkpoint.gguf_folder(path)
    assert (out / "config.json").is_file() and not (out / ENGINE_FILE).exists() and temp_files(out)
    checkpoint.resolve_checkpoint(str(path))
    assert one_line(capsys.readouterr().err) == f"converting {path} -> {out} (once)"
    torch.testing.assert_close(served(out), gguf_embedding(path))
    assert temp_files(out) == []


@pytest.mark.parametrize("first,limit,failed", [(True, 50_000, ENGINE_FILE), (False, 50_000, ENGINE_FILE),
                                                (False, 1_000, "tokenizer.json")],
                         ids=["first-conversion", "reconversion", "reconversion-tokenizer"])
def test_full_disk_during_conversion(tmp_path, ckpts, capsys, first, limit, failed):
    """RLIMIT_FSIZE below the engine file's (or tokenizer.json's) size: one line naming the file, exit 2, no
    traceback, no temporary file, nothing trusted; the next run without the limit converts."""
    a, b = gguf_pair(tmp_path)
    path = Path(shutil.copy(a, tmp_path / "m.gguf"))
    out = checkpoint.gguf_folder(path)
    if not first:
        checkpoint.resolve_checkpoint(str(path))
        overwrite_in_place(path, b.read_bytes())
    r = run_with_fsize(limit, ckpts, "scripts/convert_hf_checkpoint.py", "--checkpoint", str(path),
                       "--out-dir", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert one_line(r.stderr) == (f"error: cannot write {out / failed}: File too large (free some space or "
                                  "raise the file size limit, then run again)")
    assert temp_files(out) == []
    assert (out / ENGINE_FILE).exists() is not first
    capsys.readouterr()
    checkpoint.resolve_checkpoint(str(path))
    line = one_line(capsys.readouterr().err)
    assert line == (f"converting {path} -> {out} (once)" if first else
                    f"{path} changed since it was converted: converting again")
    torch.testing.assert_close(served(out), gguf_embedding(b if not first else a))


def test_stale_temporary_files_are_removed_but_not_a_live_process(tmp_path, ckpts):
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (out / f"{TMP_PREFIX}{dead_pid}-{ENGINE_FILE}").write_bytes(b"x" * 1000)
    (out / f"{TMP_PREFIX}{dead_pid}-tokenizer").mkdir()
    (out / "budgetkv.tmp").write_bytes(b"x")  # the old save_engine's name
    (out / f"{TMP_PREFIX}{os.getpid()}-config.json").write_text("{}")  # alive: may still be written
    checkpoint.resolve_checkpoint(str(path))
    assert temp_files(out) == [f"{TMP_PREFIX}{os.getpid()}-config.json"]


# ------------------------------------------------------------------------------------- (e) quantize.py

def quantize_argv(src, out, mode="int8", *extra):
    return ["scripts/quantize.py", "--checkpoint", str(src), "--mode", mode, "--out", str(out), *extra]


def float_of_int8(qdir: Path, name="layers.0.attention.wqkv") -> torch.Tensor:
    with safe_open(str(qdir / ENGINE_FILE), "pt") as f:
        return f.get_tensor(f"{name}.weight").float() * f.get_tensor(f"{name}.scales")[:, None]


def hf_wqkv(d: Path) -> torch.Tensor:
    t = load_file(str(d / "model.safetensors"))
    return torch.cat([t[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])


@pytest.fixture
def hf_src(hf_tiny, tmp_path):
    _, src = hf_tiny("llama")
    return Path(shutil.copytree(src, tmp_path / "hf"))


def test_quantized_checkpoint_follows_its_source(hf_src, tmp_path, capsys):
    import quantize
    q = tmp_path / "q"
    quantize.quantize_dir(hf_src, "int8", out=q)
    capsys.readouterr()
    assert checkpoint.resolve_checkpoint(str(q)) == q and capsys.readouterr().err == ""
    tmp = tmp_path / "new.safetensors"
    new = {k: -v if "self_attn" in k else v for k, v in load_file(str(hf_src / "model.safetensors")).items()}
    save_file(new, str(tmp), metadata={"format": "pt"})
    overwrite_in_place(hf_src / "model.safetensors", tmp.read_bytes(), keep_mtime=True)
    checkpoint.resolve_checkpoint(str(q))
    assert one_line(capsys.readouterr().err) == (f"{hf_src / 'model.safetensors'} changed since it was quantized: "
                                                 "quantizing again")
    torch.testing.assert_close(float_of_int8(q), hf_wqkv(hf_src), atol=0.01, rtol=0)


def test_killed_quantization(hf_src, tmp_path, ckpts, capsys):
    """Over an int8 checkpoint, an int4 quantization is SIGKILLed before its engine file: the next run redoes the
    int8 one (the engine file's), not an int4 config over int8 weights. Into a new folder: refused in one line."""
    import quantize
    q = tmp_path / "q"
    quantize.quantize_dir(hf_src, "int8", out=q)
    kill_at(ENGINE_FILE, ckpts, tmp_path, *quantize_argv(hf_src, q, "int4", "--groupsize", "32"))
    assert json.loads((q / "config.json").read_text())[quantize.MARKER]["mode"] == "int4" and temp_files(q)
    capsys.readouterr()
    assert checkpoint.resolve_checkpoint(str(q)) == q
    assert one_line(capsys.readouterr().err) == (f"{q / 'config.json'} changed since it was written with "
                                                 f"{q / ENGINE_FILE}: quantizing again")
    assert json.loads((q / "config.json").read_text())[quantize.MARKER]["mode"] == "int8" and temp_files(q) == []
    served(q, "layers.0.attention.wqkv.weight")  # config.json and the engine file agree again
    torch.testing.assert_close(float_of_int8(q), hf_wqkv(hf_src), atol=0.01, rtol=0)

    fresh = tmp_path / "q4"
    kill_at(ENGINE_FILE, ckpts, tmp_path, *quantize_argv(hf_src, fresh, "int4", "--groupsize", "32"))
    with pytest.raises(CheckpointError, match=r"q4 is an unfinished quantization \(no budgetkv.safetensors\): run "
                                              r"scripts/quantize.py again, or delete it"):
        checkpoint.resolve_checkpoint(str(fresh))


def test_full_disk_during_quantization(hf_src, tmp_path, ckpts, capsys):
    import quantize
    q = tmp_path / "q"
    quantize.quantize_dir(hf_src, "int8", out=q)
    old = load_file(str(q / ENGINE_FILE))
    r = run_with_fsize(20_000, ckpts, *quantize_argv(hf_src, q, "int4", "--groupsize", "32"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert one_line(r.stderr).startswith(f"error: cannot write {q / ENGINE_FILE}: File too large")
    assert temp_files(q) == []
    capsys.readouterr()
    checkpoint.resolve_checkpoint(str(q))  # config.json says int4 now: redone from the engine file's record
    assert one_line(capsys.readouterr().err).endswith(": quantizing again")
    assert load_file(str(q / ENGINE_FILE)).keys() == old.keys()
    from scripts import quantize as quantize_script
    assert quantize_script.main(quantize_argv(hf_src, q, "int4", "--groupsize", "32")[1:]) == 0
    assert checkpoint.resolve_checkpoint(str(q)) == q
    assert "layers.0.attention.wqkv.scales_and_zeros" in load_file(str(q / ENGINE_FILE))


# ------------------------------------------------------------------------------ a half-finished download

def test_unfinished_download_says_how_to_resume(hf_src, tmp_path, ckpts, monkeypatch, capfd):
    """huggingface_hub writes each file whole, then renames it: an interrupted download lacks files."""
    d = hf_src
    (d / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (d / ".cache" / "huggingface" / "download" / "x.1234.incomplete").write_bytes(b"x" * 100)
    index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"holds an unfinished download \(1 of 2 weight files missing, e.g. "
                                        r"model-00002-of-00002.safetensors\): resume it with python "
                                        r"scripts/download.py --repo-id <org/name> --out-dir .*, or delete"):
        checkpoint.resolve_checkpoint(str(d))
    single = Path(shutil.copytree(d, tmp_path / "single"))
    (single / "model.safetensors.index.json").unlink()
    (single / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"single holds an unfinished download \(no \*.safetensors weights yet\)"):
        checkpoint.resolve_checkpoint(str(single))
    monkeypatch.setitem(checkpoint.MODELS, "tiny", "acme/tiny")
    shutil.copytree(d, ckpts / "acme" / "tiny")
    capfd.readouterr()
    # the hub could not finish it: an environment failure (exit 1), not bad input
    with pytest.raises(checkpoint.DownloadError, match=r"acme/tiny holds an unfinished download of acme/tiny \(1 of 2 "
                                                       r"weight files missing, e.g. model-00002-of-00002.safetensors\): "
                                                       r"run again where the hub is reachable to resume it, or delete"):
        checkpoint.resolve_checkpoint("tiny")
    assert capfd.readouterr().err == ""  # huggingface_hub's own "Returning existing local_dir" warning is not shown


# ------------------------------------------------------------------------------ (f) GGUF metadata

def as_string(key, value):
    return lambda w: w.add_string(f"llama.{key}", value)


BAD_GGUF = [
    (dict(meta={"head_count": 0}), "llama.attention.head_count must be a positive integer, not 0"),
    (dict(meta={"head_count_kv": 3}), r"llama.attention.head_count \(4\) is not a multiple of "
                                      r"llama.attention.head_count_kv \(3\)"),
    (dict(meta={"embedding_length": 0}), "llama.embedding_length must be a positive integer, not 0"),
    (dict(meta={"embedding_length": 30, "rope_dimension_count": None}),
     r"llama.embedding_length \(30\) is not a multiple of llama.attention.head_count \(4\)"),
    (dict(meta={"block_count": 0}), "llama.block_count must be a positive integer, not 0"),
    (dict(meta={"block_count": 2}), r"llama.block_count is 2, but its tensors are those of 1 layer \(blk.N.\*\)"),
    (dict(meta={"block_count": 2 ** 31 - 1}), "llama.block_count is 2147483647, but its tensors are those of 1 layer"),
    (dict(meta={"embedding_length": 2 ** 31 - 1}), r"tensor token_embd.weight has shape \[260, 32\], expected "
                                                   r"\[260, 2147483647\] from its metadata"),
    (dict(meta={"feed_forward_length": 0}), "llama.feed_forward_length must be a positive integer, not 0"),
    (dict(meta={"context_length": None}), "lacks llama.context_length"),
    (dict(meta={"context_length": as_string("context_length", "abc")}),
     "llama.context_length must be a positive integer, not 'abc'"),
    (dict(meta={"rope_freq_base": 0.0}), "llama.rope.freq_base must be a positive number, not 0.0"),
    (dict(meta={"rope_freq_base": -1.0}), "llama.rope.freq_base must be a positive number, not -1.0"),
    (dict(meta={"rope_freq_base": float("nan")}), "llama.rope.freq_base must be a positive number, not nan"),
    (dict(meta={"rope_freq_base": float("inf")}), "llama.rope.freq_base must be a positive number, not inf"),
    (dict(meta={"rope_dimension_count": 7}), "the head dimension 7 is odd"),
    (dict(eps=0.0), "llama.attention.layer_norm_rms_epsilon must be a positive number, not 0.0"),
    (dict(rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=0.0),
     "llama.rope.scaling.factor must be a positive number, not 0.0"),
    (dict(rope_scaling_type=gguf.RopeScalingType.LINEAR), "lacks llama.rope.scaling.factor"),
    (dict(drop=("token_embd.weight",)), "lacks tensor 'token_embd.weight'"),
    (dict(drop=("blk.0.ffn_down.weight",)), "lacks tensor 'blk.0.ffn_down.weight'"),
    (dict(meta={"feed_forward_length": 32}), r"tensor blk.0.ffn_gate.weight has shape \[64, 32\], expected "
                                             r"\[32, 32\] from its metadata"),
]


@pytest.mark.parametrize("spec,message", BAD_GGUF, ids=[m[:40] for _, m in BAD_GGUF])
def test_bad_gguf_metadata_is_one_line_naming_the_field(tmp_path, ckpts, capsys, spec, message):
    from scripts import quantize as quantize_script
    path = write_tiny_llama(tmp_path / "bad.gguf", **spec)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.resolve_checkpoint(str(path))
    assert quantize_script.main(["--checkpoint", str(path), "--mode", "int8"]) == 2
    line = one_line(capsys.readouterr().err)  # no "converting" line: the metadata is checked first
    assert line.startswith("error: GGUF file bad.gguf") and not ckpts.exists(), line


@pytest.mark.parametrize("content", [b"", b"GGUX" + b"\0" * 100, b"GGUF\3\0\0\0" + b"\xff" * 20],
                         ids=["empty", "bad-magic", "truncated"])
def test_unreadable_gguf_fails_before_converting(tmp_path, ckpts, capsys, content):
    from scripts import quantize as quantize_script
    (tmp_path / "bad.gguf").write_bytes(content)
    assert quantize_script.main(["--checkpoint", str(tmp_path / "bad.gguf"), "--mode", "int8"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot read GGUF file {tmp_path / 'bad.gguf'}"), line
    assert not ckpts.exists()


# ------------------------------------------------------------------------------ permissions

@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_written_files_keep_the_permissions_a_user_expects(hf_src, tmp_path, ckpts, umask_027):
    """A conversion's and a quantization's files get the umask's permissions (safetensors alone creates 0600), and a
    file written over another keeps the permissions of the one it replaces."""
    import quantize
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    q = tmp_path / "q"
    quantize.quantize_dir(hf_src, "int8", out=q)
    for folder in (out, q):
        for name in (ENGINE_FILE, "config.json"):
            assert oct((folder / name).stat().st_mode & 0o777) == oct(0o640), folder / name
    (q / ENGINE_FILE).chmod(0o644)
    (q / "config.json").chmod(0o604)
    quantize.quantize_dir(hf_src, "int4", out=q, groupsize=32)
    assert [oct((q / n).stat().st_mode & 0o777) for n in (ENGINE_FILE, "config.json")] == [oct(0o644), oct(0o604)]


# ------------------------------------------------------------------------- (g) a load reads what was verified

def swap_in(engine_file_of: Path, folder: Path) -> None:
    """What another run converting into `folder` does there: its engine file renamed over the one in place."""
    os.replace(engine_file_of / ENGINE_FILE, folder / ENGINE_FILE)


def test_a_conversion_replaced_after_its_check_is_never_loaded(tmp_path, ckpts, capfd, monkeypatch):
    """A's conversion is checked, then another run renames B's engine file into A's folder before the load: the
    load (generate.py's, and a quantization reading it) is one line, exit 2, never B's weights; the next run
    converts A again, saying whose conversion the folder held."""
    import generate
    import quantize
    a, b = gguf_pair(tmp_path)
    path = Path(shutil.copy(a, tmp_path / "m.gguf"))
    out = checkpoint.resolve_checkpoint(str(path))
    convert.convert_gguf(b, tmp_path / "other")  # B's conversion, written by "another run"
    real = checkpoint.resolve_checkpoint

    def resolve_then_swap(name, *a):
        d = real(name, *a)
        swap_in(tmp_path / "other", d)
        return d
    monkeypatch.setattr(generate, "resolve_checkpoint", resolve_then_swap)
    capfd.readouterr()
    assert generate.main(["--checkpoint", str(path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert one_line(capfd.readouterr().err) == (f"error: {out / ENGINE_FILE} changed while it was being loaded "
                                                f"(another run converted or quantized into {out}?): run again")
    with pytest.raises(CheckpointError, match="changed while it was being loaded"):
        quantize.quantize_dir(out, "int8", out=tmp_path / "q")

    assert checkpoint.resolve_checkpoint(str(path)) == out
    assert one_line(capfd.readouterr().err) == f"converting {path} -> {out} again: it holds the conversion of {b}"
    torch.testing.assert_close(served(out), gguf_embedding(a))


def test_a_quantization_replaced_after_its_check_is_never_loaded(hf_src, tmp_path):
    """The same for a quantized checkpoint, read whole or by a tensor-parallel rank's slices, and for an HF folder
    checked without an engine file, into which another run then converts."""
    import types

    import quantize
    import ranks
    import tp
    from loading import load_model
    q = tmp_path / "q"
    quantize.quantize_dir(hf_src, "int8", out=q)
    other = Path(shutil.copytree(hf_src, tmp_path / "other"))
    save_file(changed_weights(other), str(other / "model.safetensors"))
    quantize.quantize_dir(other, "int8", out=tmp_path / "q-other")
    assert checkpoint.resolve_checkpoint(str(q)) == q
    swap_in(tmp_path / "q-other", q)
    mesh = ranks.Mesh(0, 2, 0, types.SimpleNamespace(group_name="stand-in"))
    for load in (lambda: load_model(q, torch.float32, "cpu"), lambda: tp.load_model(q, torch.float32, "cpu", mesh)):
        with pytest.raises(CheckpointError, match=f"{q / ENGINE_FILE} changed while it was being loaded"):
            load()

    assert checkpoint.resolve_checkpoint(str(hf_src)) == hf_src and not (hf_src / ENGINE_FILE).exists()
    convert.convert_hf_dir(other)
    swap_in(other, hf_src)
    with pytest.raises(CheckpointError, match=f"{hf_src / ENGINE_FILE} changed while it was being loaded"):
        load_model(hf_src, torch.float32, "cpu")

"""Convert a Hugging Face checkpoint (safetensors) or a llama.cpp GGUF file into a budgetkv checkpoint (the library;
the command line is scripts/convert_hf_checkpoint.py).

A budgetkv checkpoint is a directory with `config.json` (HF format), `budgetkv.safetensors` (engine names, fused
q/k/v and gate/up, HF rotate-half layout) and the tokenizer files. HF directories are converted in place (the
engine file lands beside the HF files, as gpt-fast does); a GGUF becomes a new directory.

A converted (or quantized) engine file is a cache of its source, and carries the source's identity in its own
safetensors metadata: the sha256 of every source file, and of every file written beside it (config.json, tokenizer
files). Every file is written to a temporary name in its folder, fsynced and renamed into place, the engine file
last, so a killed or failed conversion leaves the old complete state or an engine file whose identity no longer
matches. `stale` checks an identity; a small stat cache (.budgetkv-stat.json) spares re-hashing unchanged files.
The identity a check found current, or a write wrote, is the only one a load then reads (`verified`,
`check_loaded`). docs/checkpoints.md states the promise.

Nothing is ever unpickled: only safetensors (and GGUF) are read.
"""
import hashlib
import json
import math
import os
import re
import shutil
import struct
import time
from pathlib import Path

import torch

from config import parse_config
from errors import UserError
from files import (TMP_PREFIX, fsync_path, parse_json, read_json, regular_file, remove_stale_tmp, tmp_path,
                   write_atomic, write_error, write_text)
from progress import Progress, Ticker
from tokenizer import TokenizerError, write_gguf_tokenizer

ENGINE_FILE = "budgetkv.safetensors"
# Recorded in every engine file's identity; a file written by another converter version is converted again
# (2: tokenizer.ggml.pre honoured; 3: the source's identity recorded in the engine file itself).
CONVERTER = 4  # 4: config.json names the GGUF weight type
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
VERIFIED: dict[str, dict | None] = {}  # engine file -> its identity as checked or written by this process (verified)
STAT_FILE = ".budgetkv-stat.json"  # (size, mtime, ctime, inode) -> sha256 per file; never authoritative
RACY_NS = 10**9  # a file changed less than this before it was looked at is hashed again next time (as git does)


class CheckpointError(UserError):
    """A checkpoint that cannot be read; the message is one line for the user."""


def hf_to_engine(get, names: set[str], n_layers: int, tied: bool, on_layer=None) -> dict[str, torch.Tensor]:
    """Rename and fuse HF Llama/Mistral/Qwen2 tensors. `get(name)` loads one tensor, `names` lists those present;
    on_layer(layers done), if given, after each layer."""
    def need(name):
        if name not in names:
            raise CheckpointError(f"the checkpoint lacks tensor {name!r}")
        return get(name)

    def fuse(prefix, parts):
        tensors = [need(prefix + part) for part in parts]
        if len({(t.dim(), t.shape[1:]) for t in tensors}) > 1:
            shown = ", ".join(f"{prefix + part} {list(t.shape)}" for part, t in zip(parts, tensors))
            raise CheckpointError(f"the checkpoint's tensors to fuse disagree in shape: {shown}")
        return torch.cat(tensors)

    out = {"tok_embeddings.weight": need("model.embed_tokens.weight"), "norm.weight": need("model.norm.weight")}
    if not tied:
        out["output.weight"] = need("lm_head.weight")
    for i in range(n_layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        out[e + "attention_norm.weight"] = need(p + "input_layernorm.weight")
        out[e + "ffn_norm.weight"] = need(p + "post_attention_layernorm.weight")
        out[e + "attention.wqkv.weight"] = fuse(p + "self_attn.", [f"{x}_proj.weight" for x in "qkv"])
        if p + "self_attn.q_proj.bias" in names:
            out[e + "attention.wqkv.bias"] = fuse(p + "self_attn.", [f"{x}_proj.bias" for x in "qkv"])
        out[e + "attention.wo.weight"] = need(p + "self_attn.o_proj.weight")
        if p + "self_attn.o_proj.bias" in names:
            out[e + "attention.wo.bias"] = need(p + "self_attn.o_proj.bias")
        out[e + "feed_forward.w13.weight"] = fuse(p + "mlp.", ["gate_proj.weight", "up_proj.weight"])
        out[e + "feed_forward.w2.weight"] = need(p + "mlp.down_proj.weight")
        if on_layer is not None:
            on_layer(i + 1)
    return out


HF_COPY_MARK = ".budgetkv-hf-copy"  # written first into a folder write_hf fills: an earlier copy's, to replace
HF_COPY_FILES = (HF_COPY_MARK, "config.json", "model.safetensors", *TOKENIZER_FILES)  # what write_hf writes


def check_hf_copy_dir(out_dir: Path) -> None:
    """CheckpointError when the folder `out_dir` is not empty and not an earlier copy's (write_hf's mark), or holds
    what write_hf does not write (another model's weights or config, a budgetkv checkpoint): an HF copy replaces an
    earlier copy's files only."""
    if not out_dir.is_dir():
        return
    files = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(TMP_PREFIX))
    other = [name for name in files if name not in HF_COPY_FILES]
    if other or (files and HF_COPY_MARK not in files):
        held = ", ".join((other or files)[:3]) + (", ..." if len(other or files) > 3 else "")
        raise CheckpointError(f"{out_dir} holds {held}, and is not a folder an HF copy wrote (another model's "
                              "folder?): pick a new or empty folder")


def write_hf(ckpt_dir: Path, out_dir: Path) -> Path:
    """Write an HF-loadable copy of a converted budgetkv checkpoint (transformers' `from_pretrained(out_dir)`):
    model.safetensors in HF names (q/k/v and gate/up split again; the layout is already HF's rotate-half), config.json
    and the tokenizer files, replacing an earlier copy's (its files that this one lacks removed; the weights gone
    until the rest is written). A quantized checkpoint cannot be written (HF has no such weights), nor a folder
    holding other files (check_hf_copy_dir). Returns out_dir."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file
    check_hf_copy_dir(out_dir)
    config = read_config(ckpt_dir)
    try:
        engine = load_file(str(ckpt_dir / ENGINE_FILE))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {ckpt_dir / ENGINE_FILE} (not a converted checkpoint?): {e}") from None
    if any(name.endswith((".scales", ".scales_and_zeros")) for name in engine):
        raise CheckpointError(f"{ckpt_dir} is quantized: write the HF copy from the float checkpoint it came from")
    args = parse_config(config)
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    engine = checked_engine(engine, ckpt_dir / ENGINE_FILE, args.n_layers, q + 2 * kv)
    out = {"model.embed_tokens.weight": engine["tok_embeddings.weight"], "model.norm.weight": engine["norm.weight"]}
    if "output.weight" in engine:
        out["lm_head.weight"] = engine["output.weight"]
    for i in range(args.n_layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = engine[e + "attention_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = engine[e + "ffn_norm.weight"]
        for kind in ("weight", "bias"):
            if e + f"attention.wqkv.{kind}" in engine:
                for x, part in zip("qkv", engine[e + f"attention.wqkv.{kind}"].split([q, kv, kv])):
                    out[p + f"self_attn.{x}_proj.{kind}"] = part
            if e + f"attention.wo.{kind}" in engine:
                out[p + f"self_attn.o_proj.{kind}"] = engine[e + f"attention.wo.{kind}"]
        gate, up = engine[e + "feed_forward.w13.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = engine[e + "feed_forward.w2.weight"]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {out_dir}: {e.strerror or e}") from None
    write_text(out_dir / HF_COPY_MARK, "an HF copy written by budgetkv (convert_hf_checkpoint.py --to-hf)\n")
    for name in ("model.safetensors", *TOKENIZER_FILES):  # an earlier copy's, never beside this one's weights
        if name == "model.safetensors" or not (ckpt_dir / name).is_file():
            try:
                (out_dir / name).unlink(missing_ok=True)
            except OSError as e:
                raise write_error(out_dir / name, e) from None
    for name in TOKENIZER_FILES:
        if (ckpt_dir / name).is_file():
            write_atomic(out_dir / name, lambda tmp, src=ckpt_dir / name: shutil.copyfile(src, tmp))
    write_text(out_dir / "config.json", json.dumps(config, indent=2))
    write_atomic(out_dir / "model.safetensors", lambda tmp: save_file(
        {k: v.contiguous() for k, v in out.items()}, str(tmp), metadata={"format": "pt"}))
    return out_dir


def check_float(t: torch.Tensor, name: str, where: Path) -> None:
    """A checkpoint's weight is float32, float16 or bfloat16 (CheckpointError naming it and `where` otherwise)."""
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"tensor {name} in {where} is {t.dtype}, not float32, float16 or bfloat16")


def checked_engine(engine: dict, path: Path, n_layers: int, qkv_rows: int) -> dict:
    """engine, when it holds every tensor write_hf splits and its fused q/k/v rows match the config's heads."""
    names = ["tok_embeddings.weight", "norm.weight"] + [f"layers.{i}.{n}" for i in range(n_layers) for n in (
        "attention_norm.weight", "ffn_norm.weight", "attention.wqkv.weight", "feed_forward.w13.weight",
        "feed_forward.w2.weight")]
    missing = [n for n in names if n not in engine]
    if missing:
        raise CheckpointError(f"{path} lacks tensor {missing[0]!r} (not this config.json's checkpoint?)")
    for name, t in engine.items():
        check_float(t, name, path)
    for i in range(n_layers):
        rows = engine[f"layers.{i}.attention.wqkv.weight"].shape[0]
        if rows != qkv_rows:
            raise CheckpointError(f"{path}: layers.{i}.attention.wqkv.weight has {rows} rows, its config.json's "
                                  f"heads make {qkv_rows}")
    return engine


def read_hf_dir(ckpt_dir: Path, dtype: torch.dtype | None = None,
                progress: str | None = None) -> dict[str, torch.Tensor]:
    """Engine-named tensors from an HF directory's *.safetensors (sharded or not), read lazily one at a time.
    progress: the label of a progress line over the layers read (progress.py: a terminal's, past a delay)."""
    from safetensors import SafetensorError, safe_open

    config = read_config(ckpt_dir)
    files = hf_weights(ckpt_dir)
    if not files:
        raise CheckpointError(f"{ckpt_dir} has no *.safetensors weights")
    where = {}
    try:
        for f in files:
            h = safe_open(str(f), "pt", device="cpu")
            for name in h.keys():
                if name in where:
                    raise CheckpointError(f"tensor {name} is in two weight files of {ckpt_dir} ({where[name][1].name} "
                                          f"and {f.name}): which one holds the model's?")
                where[name] = (h, f)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read the safetensors in {ckpt_dir} (truncated or corrupt?): {e}") from None

    def get(name):
        try:
            t = where[name][0].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name} in {ckpt_dir} (truncated or corrupt?): {e}") from None
        check_float(t, name, ckpt_dir)
        return t.to(dtype) if dtype is not None else t

    tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in where
    n_layers = config.get("num_hidden_layers")
    if type(n_layers) is not int or n_layers < 1:
        raise CheckpointError(f"{ckpt_dir}/config.json lacks a valid num_hidden_layers")
    layers = len({name.split(".")[2] for name in where if name.startswith("model.layers.")})
    if layers != n_layers:  # before any per-layer work
        raise CheckpointError(f"weights in {ckpt_dir} have {layers} layers, its config.json's num_hidden_layers says "
                              f"{n_layers}")
    with Progress(n_layers, progress or "", "layers", enabled=progress is not None) as bar:
        return hf_to_engine(get, set(where), n_layers, tied, bar.update)


def read_config(ckpt_dir: Path) -> dict:
    path = ckpt_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no config.json")
    try:
        config = read_json(path)
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def hf_weights(ckpt_dir: Path) -> list[Path]:
    """An HF directory's weight files (the engine file is not one of them)."""
    files = sorted(f for f in ckpt_dir.glob("*.safetensors") if f.name != ENGINE_FILE)
    for f in files:
        regular_file(f)
    return files


def hf_sources(ckpt_dir: Path) -> list[Path]:
    """What an in-place conversion reads: the HF weights and config.json."""
    config = ckpt_dir / "config.json"
    return hf_weights(ckpt_dir) + ([config] if config.is_file() else [])


def checkpoint_files(ckpt_dir: Path) -> list[Path]:
    """What a quantization reads from a float checkpoint: config.json, its weights (the engine file when there is
    one, else the HF weights) and the tokenizer files it copies."""
    engine = ckpt_dir / ENGINE_FILE
    weights = [engine] if engine.is_file() else hf_weights(ckpt_dir)
    return [ckpt_dir / "config.json", *weights] + [ckpt_dir / n for n in TOKENIZER_FILES if (ckpt_dir / n).is_file()]


def convert_hf_dir(ckpt_dir: Path) -> Path:
    """Write budgetkv.safetensors beside the HF files, carrying their identity; returns the directory."""
    remove_stale_tmp(ckpt_dir)
    stats = load_stats(ckpt_dir)
    sources = {f.name: file_sha256(f, stats) for f in hf_sources(ckpt_dir)}  # before reading: a later change shows
    tensors = read_hf_dir(ckpt_dir, progress=f"converting {ckpt_dir.name}")
    save_engine(tensors, ckpt_dir / ENGINE_FILE, identity("hf", ckpt_dir, sources, {}))
    save_stats(stats)
    return ckpt_dir


def save_engine(tensors: dict[str, torch.Tensor], path: Path, ident: dict) -> None:
    """The engine file, written last and atomically, with the identity of what it was converted from (a terminal
    shows the seconds it takes, from the first on)."""
    from safetensors.torch import save_file
    metadata = {"format": "budgetkv", "budgetkv_identity": json.dumps(ident)}
    with Ticker(f"writing {path}"):
        write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                                                 metadata=metadata))
    verified(path, identity_in(metadata))


# ------------------------------------------------------------------------------------------- source identity

def identity(kind: str, source: Path, sources: dict, companions: dict, **extra) -> dict:
    """What an engine file records: its converter, the kind of conversion ("hf", "gguf", "quantized"), the source
    (a file or a folder), the sha256 of each source file and of each file written beside it."""
    return {"converter": CONVERTER, "kind": kind, "source": str(source.resolve()), "sources": sources,
            "companions": companions, **extra}


def read_identity(engine: Path) -> dict | None:
    """The identity in an engine file's metadata; None when there is no such file, or it has none (an older
    converter's), or one this converter did not write."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(engine), "pt") as f:  # reads the header only
            return identity_in(f.metadata())
    except (OSError, SafetensorError):
        return None


def identity_in(metadata: dict | None) -> dict | None:
    """The identity in an engine file's metadata (read_identity's rules)."""
    try:
        ident = parse_json((metadata or {}).get("budgetkv_identity", "null"))
    except ValueError:
        return None
    ok = (isinstance(ident, dict) and ident.get("converter") == CONVERTER and isinstance(ident.get("source"), str)
          and all(isinstance(ident.get(k), dict) for k in ("sources", "companions"))
          and all(Path(n).name == n and n not in ("", ".", "..") for n in ident["companions"]))  # names, no paths
    return ident if ok else None


def verified(engine: Path, ident: dict | None) -> None:
    """Record the identity of `engine` that this process checked against its source or wrote (None: no engine file,
    or one with no identity): the only one a load of it may read."""
    VERIFIED[str(engine.parent.resolve() / engine.name)] = ident


def check_loaded(engine: Path, metadata: dict | None) -> None:
    """CheckpointError unless the engine file being read carries the identity verified for it, where one was:
    metadata from the handle its tensors are read through (None: there is no engine file). Another run may have
    converted or quantized into the folder since it was checked."""
    key = str(engine.parent.resolve() / engine.name)
    if key in VERIFIED and identity_in(metadata) != VERIFIED[key]:
        raise CheckpointError(f"{engine} changed while it was being loaded (another run converted or quantized into "
                              f"{engine.parent}?): run again")


def load_stats(folder: Path) -> dict:
    path = folder / STAT_FILE
    try:
        old = read_json(path)
    except (OSError, ValueError):
        old = {}
    return {"path": path, "old": old if isinstance(old, dict) else {}, "new": {}}


def save_stats(stats: dict) -> None:
    """Keep the stat cache of the files looked at this time (best effort: a read-only folder keeps none)."""
    if stats["new"] != stats["old"] and stats["path"].parent.is_dir():
        try:
            write_text(stats["path"], json.dumps(stats["new"]))
        except CheckpointError:
            pass


def hash_file(path: Path) -> str:
    """sha256 of a file, read 1 MiB at a time (a progress line for a large one on a terminal: progress.py)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        mib = (os.fstat(f.fileno()).st_size + (1 << 20) - 1) >> 20
        with Progress(mib, f"hashing {path.name}", "MiB") as bar:
            done = 0
            while chunk := f.read(1 << 20):
                h.update(chunk)
                done += 1
                bar.update(done)
    return h.hexdigest()


def file_sha256(path: Path, stats: dict) -> str | None:
    """sha256 of a file (None if it is missing). A file whose size, mtime, ctime and inode are those the stat cache
    recorded with a hash is not read again; any change to the file (even with its mtime restored) moves its ctime."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    key, name = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], str(path.resolve())
    hit = stats["old"].get(name)
    if isinstance(hit, list) and hit[:4] == key and len(hit) == 5:
        stats["new"][name] = hit
        return hit[4]
    try:
        sha = hash_file(path)
        after = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    same = [after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino] == key
    if same and time.time_ns() - st.st_ctime_ns > RACY_NS:  # changed within RACY_NS: its stat may not show the next
        stats["new"][name] = key + [sha]
    return sha


def stale(out_dir: Path, ident: dict, sources: list[Path] | None) -> str | None:
    """None when the engine file in out_dir (whose identity is `ident`) is a conversion of `sources` as they are now
    (None: the source is gone, skip it) and the files written beside it are those it was written with; otherwise
    what changed, as the start of a line ("<file> changed since it was converted")."""
    stats, done = load_stats(out_dir), "quantized" if ident["kind"] == "quantized" else "converted"
    try:
        why = None
        if sources is not None:
            now = {f.name: file_sha256(f, stats) for f in sources}
            for name in sorted(set(now) | set(ident["sources"])):
                if now.get(name) != ident["sources"].get(name):
                    where = next((f for f in sources if f.name == name), Path(ident["source"]))
                    why = f"{where} changed since it was {done}"
                    break
        for name, sha in ident["companions"].items():
            if why is None and file_sha256(out_dir / name, stats) != sha:
                why = f"{out_dir / name} changed since it was written with {out_dir / ENGINE_FILE}"
    finally:
        save_stats(stats)
    return why


# ----------------------------------------------------------------------------------------------------------- GGUF

def _gguf_value(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    if not field.types or field.types[0].name == "ARRAY" or not field.data:
        return [None]  # not a scalar: fails every type check below, with the key's name
    value = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0]


def unpermute_gguf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE layout -> HF rotate-half layout)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


GGUF_MAX_ITEMS = 2 ** 20  # metadata entries, tensors, or elements of one metadata array (vocabularies: ~260K)
GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types


def check_gguf_counts(gguf_path: Path) -> None:
    """A GGUF's header and metadata walked before gguf.GGUFReader parses them into Python objects (many times the
    file's bytes for an array of small items): every count at most GGUF_MAX_ITEMS, CheckpointError naming the key."""
    def read(f, fmt):
        data = f.read(struct.calcsize(fmt))
        if len(data) < struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def key(f):  # a key longer than the rest of the file is damage, never a read of its declared size
        n = read(f, "<Q")
        if n > os.fstat(f.fileno()).st_size - f.tell():
            raise EOFError
        return f.read(n).decode("utf-8", "replace")[:80]

    def count(f, what):
        n = read(f, "<Q")
        if n > GGUF_MAX_ITEMS:
            raise CheckpointError(f"cannot read GGUF file {gguf_path}: it declares {n} {what}, more than "
                                  f"{GGUF_MAX_ITEMS} (refused before reading them)")
        return n

    def skip(f, kind, key):
        if kind in GGUF_SIZES:
            f.seek(GGUF_SIZES[kind], 1)
        elif kind == 8:
            f.seek(read(f, "<Q"), 1)
        elif kind == 9:
            item = read(f, "<I")
            for _ in range(count(f, f"elements in {key}")):
                skip(f, item, key)
        else:
            raise EOFError  # an unknown type: GGUFReader names the damage
    try:
        with open(gguf_path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return  # GGUFReader says what it is
            count(f, "tensors")
            for _ in range(count(f, "metadata entries")):
                name = key(f)
                skip(f, read(f, "<I"), name)
    except EOFError:
        return


def read_gguf(gguf_path: Path):
    """Open a llama / qwen2 GGUF and check its metadata by type and range and its tensors by name and shape, naming
    the field; returns (reader, config.json dict). Nothing is dequantized yet."""
    import gguf
    check_gguf_counts(gguf_path)
    try:
        with Ticker(f"reading {gguf_path.name}"):  # seconds: the tokenizer's vocabulary is parsed here
            reader = gguf.GGUFReader(str(gguf_path))
    except Exception:  # gguf (numpy underneath) raises bare ValueError / struct errors on bad files
        with open(gguf_path, "rb") as f:
            magic = f.read(4)
        why = "truncated or damaged (its header, metadata and tensors do not fit the file)" if magic == b"GGUF" \
            else "not a GGUF file (it does not start with GGUF)"
        raise CheckpointError(f"cannot read GGUF file {gguf_path}: {why}") from None
    name = gguf_path.name
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} in {name} (llama and qwen2 are supported)")
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    h = gguf_hyperparameters(reader, name, arch, shapes)
    vocab = shapes.get("token_embd.weight", (0,))[0]
    check_gguf_tensors(name, shapes, vocab, h)
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": h["dim"],
        "intermediate_size": h["ffn"],
        "num_hidden_layers": h["n_layers"],
        "num_attention_heads": h["n_heads"],
        "num_key_value_heads": h["n_kv"],
        "head_dim": h["head_dim"],
        "rms_norm_eps": float(f"{h['eps']:.7g}"),  # stored as float32: 1e-5
        "rope_theta": float(h["theta"]),
        "rope_scaling": None if h["factor"] is None else {"rope_type": "linear", "factor": h["factor"]},
        "max_position_embeddings": h["context"],
        "tie_word_embeddings": "output.weight" not in shapes,
        "source": f"converted from {name} ({gguf_weight_type(reader)} weights, dequantized to float32)",
        "gguf_converter": CONVERTER,
    }
    return reader, config


def gguf_hyperparameters(reader, name: str, arch: str, shapes: dict) -> dict:
    """The model's sizes, RMS norm epsilon and RoPE (theta, a linear scaling factor or None) from a GGUF's
    metadata, each checked by type and range, naming the key: as many layers as its tensors hold, whole GQA groups,
    an even head dimension, and no RoPE scaling the converter cannot carry over."""
    def meta(key, default=None):
        return _gguf_value(reader, f"{arch}.{key}", default)

    def positive(key, default=None, kind=int):
        v = meta(key, default)
        if v is None:
            raise CheckpointError(f"GGUF file {name} lacks {arch}.{key}")
        if kind is int and (type(v) is not int or v < 1):
            raise CheckpointError(f"GGUF file {name}: {arch}.{key} must be a positive integer, not {v!r}")
        if kind is float and (type(v) not in (int, float) or not math.isfinite(v) or v <= 0):
            raise CheckpointError(f"GGUF file {name}: {arch}.{key} must be a positive number, not {v!r}")
        return v

    n_heads = positive("attention.head_count")
    n_kv = positive("attention.head_count_kv", n_heads)
    dim, n_layers = positive("embedding_length"), positive("block_count")
    layers = len({m[1] for t in shapes if (m := re.match(r"blk\.(\d+)\.", t))})
    if layers != n_layers:  # before any per-layer work
        raise CheckpointError(f"GGUF file {name}: {arch}.block_count is {n_layers}, but its tensors are those of "
                              f"{layers} layer{'s' if layers != 1 else ''} (blk.N.*)")
    ffn, context = positive("feed_forward_length"), positive("context_length")
    if n_heads % n_kv:
        raise CheckpointError(f"GGUF file {name}: {arch}.attention.head_count ({n_heads}) is not a multiple of "
                              f"{arch}.attention.head_count_kv ({n_kv})")
    if meta("rope.dimension_count") is None and dim % n_heads:
        raise CheckpointError(f"GGUF file {name}: {arch}.embedding_length ({dim}) is not a multiple of "
                              f"{arch}.attention.head_count ({n_heads}) and {arch}.rope.dimension_count is absent")
    head_dim = positive("rope.dimension_count", dim // n_heads)
    if head_dim % 2:
        raise CheckpointError(f"GGUF file {name}: the head dimension {head_dim} is odd ({arch}.rope.dimension_count)")
    eps = positive("attention.layer_norm_rms_epsilon", kind=float)
    theta = positive("rope.freq_base", 10000.0, kind=float)
    # llama.cpp keeps Llama 3.1-style RoPE scaling as per-frequency factors (a rope_freqs tensor) instead of the
    # parameters the engine's config takes; converting without them would silently misplace every position.
    scaling = meta("rope.scaling.type", "none")
    if "rope_freqs.weight" in shapes or scaling not in ("none", "linear"):
        kind = "per-frequency factors (rope_freqs)" if "rope_freqs.weight" in shapes else repr(scaling)
        raise CheckpointError(f"GGUF file {name} uses RoPE scaling by {kind}, which the GGUF converter "
                              "does not carry over; use the model's HF checkpoint instead")
    factor = positive("rope.scaling.factor", kind=float) if scaling == "linear" else None
    return dict(n_heads=n_heads, n_kv=n_kv, dim=dim, n_layers=n_layers, ffn=ffn, context=context,
                head_dim=head_dim, eps=eps, theta=theta, factor=factor)


def check_gguf_tensors(name: str, shapes: dict, vocab: int, h: dict) -> None:
    """Every tensor the model needs is in the GGUF, and every tensor it may use has the shape its metadata gives."""
    dim, ffn, q, kv = h["dim"], h["ffn"], h["n_heads"] * h["head_dim"], h["n_kv"] * h["head_dim"]
    want = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    for i in range(h["n_layers"]):
        want |= {f"blk.{i}.{k}.weight": s for k, s in (
            ("attn_norm", (dim,)), ("ffn_norm", (dim,)), ("attn_q", (q, dim)), ("attn_k", (kv, dim)),
            ("attn_v", (kv, dim)), ("attn_output", (dim, q)), ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
            ("ffn_down", (dim, ffn)))}
    optional = {"output.weight": (vocab, dim)}
    for i in range(h["n_layers"]):
        optional |= {f"blk.{i}.{k}.bias": (n,) for k, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv),
                                                           ("attn_output", dim))}
    for t, shape in (want | optional).items():
        if t in want and t not in shapes:
            raise CheckpointError(f"GGUF file {name} lacks tensor {t!r}")
        if t in shapes and shapes[t] != shape:
            raise CheckpointError(f"GGUF file {name}: tensor {t} has shape {list(shapes[t])}, expected "
                                  f"{list(shape)} from its metadata")


def gguf_weight_type(reader) -> str:
    """The type most of a GGUF's 2-D tensors are stored in (Q4_1, F16, ...): what the model's weights were."""
    from collections import Counter
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else "unknown"


def convert_gguf(gguf_path: Path, out_dir: Path, opened=None) -> Path:
    """Dequantize a llama / qwen2 GGUF to float32 into out_dir: the tokenizer files and config.json, then
    budgetkv.safetensors carrying the GGUF's identity. `opened`: what read_gguf returned, if called already."""
    import gguf
    import numpy as np

    reader, config = opened or read_gguf(gguf_path)
    stats = load_stats(out_dir)
    sources = {gguf_path.name: file_sha256(gguf_path, stats)}  # before reading the tensors: a later change shows
    tensors = {}
    with Progress(len(reader.tensors), f"converting {gguf_path.name}", "tensors") as bar:
        for t in reader.tensors:
            try:
                with np.errstate(all="ignore"):  # damaged data is reported below, not as numpy warnings
                    data = gguf.quants.dequantize(t.data, t.tensor_type)
            except Exception as e:  # an unknown quantization type, a truncated tensor
                raise CheckpointError(f"cannot dequantize tensor {t.name} of GGUF file {gguf_path.name}: "
                                      f"{' '.join(str(e).split()) or type(e).__name__}") from None
            data = np.array(data, dtype=np.float32)  # a writable copy
            if not np.isfinite(data).all():  # numpy's one pass: torch's threads cost more than they gain here
                raise CheckpointError(f"tensor {t.name} of GGUF file {gguf_path.name} holds NaN or inf values (a "
                                      "damaged file?)")
            tensors[t.name] = torch.from_numpy(data)
            bar.update(len(tensors))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(config["num_hidden_layers"]):
        for hf, g in GGUF_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{g}.{kind}"
    llama, n_heads, n_kv = config["model_type"] == "llama", config["num_attention_heads"], config["num_key_value_heads"]

    def get(name):
        t = tensors[names[name]]
        if llama and (".q_proj." in name or ".k_proj." in name):  # llama.cpp permutes only llama q/k
            t = unpermute_gguf(t, n_heads if ".q_proj." in name else n_kv)
        return t

    present = {hf for hf, g in names.items() if g in tensors}
    engine = hf_to_engine(get, present, config["num_hidden_layers"], config["tie_word_embeddings"])
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {out_dir}: {e.strerror or e}") from None
    remove_stale_tmp(out_dir)
    companions = write_gguf_companions(reader, config, out_dir, stats)
    save_engine(engine, out_dir / ENGINE_FILE, identity("gguf", gguf_path, sources, companions))  # last
    save_stats(stats)
    return out_dir


def write_gguf_companions(reader, config: dict, out_dir: Path, stats: dict) -> dict:
    """The tokenizer files (staged in a temporary folder, then renamed one by one) and config.json, each atomically;
    returns {name: sha256} of what was written, for the engine file's identity."""
    stage = tmp_path(out_dir / "tokenizer")
    try:
        stage.mkdir()
        try:
            write_gguf_tokenizer(reader, stage)
        except TokenizerError as e:  # name the file it was for, not the staging folder
            if re.search(r"os error \d+", str(e)):
                raise write_error(out_dir / "tokenizer.json", e) from None
            raise TokenizerError(str(e).replace(str(stage), str(out_dir))) from None
        written = sorted(f.name for f in stage.iterdir())
        for f in written:
            fsync_path(stage / f)
            os.replace(stage / f, out_dir / f)
        fsync_path(out_dir)
    except OSError as e:
        failed = Path(e.filename) if e.filename else stage
        raise write_error(out_dir / (failed.name if failed.parent == stage else "tokenizer.json"), e) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    write_text(out_dir / "config.json", json.dumps(config, indent=2))
    return {f: file_sha256(out_dir / f, stats) for f in [*written, "config.json"]}

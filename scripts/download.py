"""Download the files an inference engine needs from a Hugging Face model repo.

    python scripts/download.py --repo-id meta-llama/Llama-3.1-8B-Instruct [--out-dir DIR] [--hf-token TOKEN]

Fetches config/tokenizer JSON, safetensors weights and tokenizer files only (no .bin/.pth/.gguf,
no original/ or consolidated* duplicates). HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME etc. are honoured
by huggingface_hub itself.
"""
import argparse
import os
import sys
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

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


TRANSPORT_ERRORS, HTTP_ERRORS = _http_errors()


class DownloadError(Exception):
    """A download failure, with a one-line message meant for the user."""


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]


def _explain(e: Exception, repo_id: str) -> str:
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
    if isinstance(e, (*TRANSPORT_ERRORS, LocalEntryNotFoundError)) or (status or 0) >= 500:
        reason = f"HTTP {status}" if status else _one_line(e)
        return (f"cannot reach the Hugging Face hub ({hub}: {reason}): "
                "download the model elsewhere and pass its directory as --checkpoint")
    if isinstance(e, HFValidationError):
        return f"invalid repo id {repo_id!r}: expected 'org/name'"
    return f"downloading {repo_id} from {hub} failed: {_one_line(e)}"


def download(repo_id: str, out_dir: Path, token: str | None = None) -> Path:
    """Download `repo_id` into `out_dir` and return that directory; raise DownloadError on failure."""
    try:
        path = Path(snapshot_download(
            repo_id,
            local_dir=out_dir,
            token=token or os.environ.get("HF_TOKEN"),
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        ))
    except (OSError, *HTTP_ERRORS, HFValidationError) as e:  # HfHubHTTPError, LocalEntryNotFound... are OSErrors
        raise DownloadError(_explain(e, repo_id)) from e
    if not (path / "config.json").is_file():
        raise DownloadError(f"{repo_id} has no config.json (looked in {path})")
    if not any(path.glob("*.safetensors")):
        raise DownloadError(f"{repo_id} has no safetensors weights (looked in {path})")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Download a Hugging Face model for budgetkv.")
    parser.add_argument("--repo-id", required=True, help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: checkpoints/<repo_id>")
    parser.add_argument("--hf-token", default=None, help="default: $HF_TOKEN or the saved `hf auth login` token")
    args = parser.parse_args(argv)
    try:
        path = download(args.repo_id, args.out_dir or Path("checkpoints") / args.repo_id, token=args.hf_token)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

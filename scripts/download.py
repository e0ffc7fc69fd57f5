"""Download the files an inference engine needs from a Hugging Face model repo.

    python scripts/download.py --repo-id meta-llama/Llama-3.1-8B-Instruct [--out-dir DIR] [--hf-token TOKEN]

Fetches config/tokenizer JSON, safetensors weights and tokenizer files only (no .bin/.pth/.gguf,
no original/ or consolidated* duplicates). HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME etc. are honoured
by huggingface_hub itself.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements

from checkpoint import DownloadError, DownloadRefused, download  # noqa: E402,F401  (the errors: for callers)
from cli import Parser, run_cli  # noqa: E402
from files import check_out_dir  # noqa: E402
from errors import UserError  # noqa: E402


def parse_args(argv=None):
    ap = Parser(description="Download a Hugging Face model for budgetkv.")
    ap.add_argument("--repo-id", required=True, help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: checkpoints/<repo_id> (in this directory)")
    ap.add_argument("--hf-token", default=None, help="default: $HF_TOKEN or the saved `hf auth login` token")
    return ap.parse_args(argv)


def run(a) -> int:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:  # before the default --out-dir is made of it: "../x" or "/etc" would land outside checkpoints/
        validate_repo_id(a.repo_id)
    except HFValidationError:
        raise UserError(f"invalid --repo-id {a.repo_id!r}: expected 'org/name' (letters, digits, '-', '_', '.')") \
            from None
    if a.hf_token is not None and (not a.hf_token or any(c.isspace() for c in a.hf_token)):
        raise UserError("--hf-token is empty or contains whitespace")
    out = a.out_dir or Path("checkpoints") / a.repo_id
    check_out_dir(out, "--out-dir")
    print(download(a.repo_id, out, token=a.hf_token))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

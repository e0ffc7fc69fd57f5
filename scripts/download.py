"""Download the files an inference engine needs from a Hugging Face model repo.

    python scripts/download.py --repo-id meta-llama/Llama-3.1-8B-Instruct [--out-dir DIR] [--hf-token TOKEN]

Fetches config/tokenizer JSON, safetensors weights and tokenizer files only (no .bin/.pth/.gguf,
no original/ or consolidated* duplicates). HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME etc. are honoured
by huggingface_hub itself.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint import DownloadError, download  # noqa: E402,F401  (DownloadError: for callers of this module)


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

"""Convert a Hugging Face checkpoint (safetensors) or a llama.cpp GGUF file into a budgetkv checkpoint.

A budgetkv checkpoint is a directory with `config.json` (HF format), `budgetkv.safetensors` (engine names, fused
q/k/v and gate/up, HF rotate-half layout) and the tokenizer files. HF directories are converted in place (the
engine file lands beside the HF files, as gpt-fast does); a GGUF becomes a new directory.

    python scripts/convert_hf_checkpoint.py --checkpoint checkpoints/meta-llama/Llama-3.1-8B-Instruct
    python scripts/convert_hf_checkpoint.py --checkpoint model.gguf --out-dir checkpoints/my-model

Nothing is ever unpickled: only safetensors (and GGUF) are read.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from convert import CheckpointError, convert_gguf, convert_hf_dir  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True, help="HF directory or .gguf file")
    ap.add_argument("--out-dir", type=Path, help="output directory for a GGUF (default: checkpoints/<gguf stem>)")
    a = ap.parse_args(argv)
    from tokenizer import TokenizerError
    try:
        if a.checkpoint.suffix == ".gguf":
            out = convert_gguf(a.checkpoint, a.out_dir or Path("checkpoints") / a.checkpoint.stem)
        else:
            out = convert_hf_dir(a.checkpoint)
    except (CheckpointError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

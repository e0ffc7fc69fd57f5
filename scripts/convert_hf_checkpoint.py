"""Convert a Hugging Face checkpoint (safetensors) or a llama.cpp GGUF file into a budgetkv checkpoint.

A budgetkv checkpoint is a directory with `config.json` (HF format), `budgetkv.safetensors` (engine names, fused
q/k/v and gate/up, HF rotate-half layout) and the tokenizer files. HF directories are converted in place (the
engine file lands beside the HF files, as gpt-fast does); a GGUF becomes a new directory.

    python scripts/convert_hf_checkpoint.py --checkpoint checkpoints/meta-llama/Llama-3.1-8B-Instruct
    python scripts/convert_hf_checkpoint.py --checkpoint model.gguf --out-dir checkpoints/my-model
    python scripts/convert_hf_checkpoint.py --checkpoint smollm2-135m --to-hf /tmp/smollm2-hf

--to-hf writes an HF transformers copy of any checkpoint --checkpoint names (a short name, an HF folder, a GGUF file,
a converted folder; converted first if need be): `AutoModelForCausalLM.from_pretrained(OUT)` loads it.

Nothing is ever unpickled: only safetensors (and GGUF) are read.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements

from checkpoint import gguf_folder, resolve_checkpoint  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from convert import (ENGINE_FILE, CheckpointError, check_hf_copy_dir, convert_gguf, convert_hf_dir,  # noqa: E402
                     write_hf)
from files import check_out_dir, check_writable, read_json, unreachable  # noqa: E402
from errors import UserError  # noqa: E402
import progress  # noqa: E402


def parse_args(argv=None):
    ap = Parser(description=__doc__)
    ap.add_argument("--checkpoint", type=Path, required=True,
                    help="HF directory or .gguf file (with --to-hf: anything --checkpoint accepts elsewhere)")
    ap.add_argument("--out-dir", type=Path, help="output directory for a GGUF (default: where generate.py looks for "
                                                 "it, checkpoints/<gguf stem>-<hash of its path>); an HF directory is "
                                                 "converted in place, so it takes no --out-dir")
    ap.add_argument("--to-hf", type=Path, metavar="OUT",
                    help="write an HF transformers copy (model.safetensors, config.json, tokenizer) to OUT instead")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress line (one goes to stderr only when it is a terminal and the work takes more "
                         "than a second, and is erased when it is done)")
    return ap.parse_args(argv)


def check_args(a) -> None:
    """What the conversion needs, before it reads gigabytes: an input of the right kind, an output it may write."""
    src = a.checkpoint
    if a.to_hf is not None:
        if a.out_dir is not None:
            raise UserError("--out-dir and --to-hf exclude each other (--to-hf names the HF copy's folder)")
        check_out_dir(a.to_hf, "--to-hf")
        try:
            check_hf_copy_dir(a.to_hf)
        except CheckpointError as e:
            raise UserError(f"--to-hf: {e}") from None
        return
    if why := unreachable(src):
        raise UserError(f"--checkpoint {src}: {why}")
    if src.suffix.lower() == ".gguf":
        if not src.is_file():
            raise UserError(f"--checkpoint {src} is not a file")
        out = a.out_dir or gguf_folder(src)
        check_out_dir(out, "--out-dir")
        cfg = out / "config.json"
        if cfg.is_file():  # re-converting a GGUF there is fine; overwriting another model is not
            try:
                theirs = read_json(cfg)
            except (OSError, ValueError):
                theirs = None
            if not isinstance(theirs, dict) or "gguf_converter" not in theirs:
                raise UserError(f"--out-dir {out} holds a checkpoint that is not a GGUF conversion; pick another "
                                "directory (it would be overwritten)")
        return
    if not src.is_dir():
        raise UserError(f"--checkpoint {src} is neither an HF directory nor a .gguf file")
    if a.out_dir is not None:
        raise UserError(f"--out-dir applies to a .gguf --checkpoint; the HF directory {src} is converted in place "
                        f"(its {ENGINE_FILE} lands beside its files)")
    check_writable(src / ENGINE_FILE, "--checkpoint")  # converted in place


def run(a) -> int:
    progress.quiet = a.quiet
    check_args(a)
    if a.to_hf is not None:
        src = resolve_checkpoint(str(a.checkpoint))
        if not (src / ENGINE_FILE).is_file():  # an HF folder never converted: converted in place first
            src = convert_hf_dir(src)
        out = write_hf(src, a.to_hf)
    elif a.checkpoint.suffix.lower() == ".gguf":
        out = convert_gguf(a.checkpoint, a.out_dir or gguf_folder(a.checkpoint))
    else:
        out = convert_hf_dir(a.checkpoint)
    print(out)
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

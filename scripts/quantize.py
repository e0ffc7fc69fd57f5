"""The command line of quantize.py (weight-only int8 / int4 quantization of a checkpoint; see quantize.py's docstring,
which --help prints).

    .venv/bin/python scripts/quantize.py --checkpoint smollm2-135m --mode int8
    .venv/bin/python scripts/quantize.py --checkpoint smollm2-135m --mode int4      # group size 32
"""
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # first: the library quantize.py, not this file
from errors import check_python  # noqa: E402

check_python()  # one line, not a traceback, in a Python without the requirements
import quantize  # noqa: E402
import progress  # noqa: E402
from checkpoint import resolve_checkpoint  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from files import check_out_dir, read_json  # noqa: E402
from errors import UserError  # noqa: E402


def parse_args(argv=None):
    ap = Parser(description=quantize.__doc__)
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="what generate.py's --checkpoint takes: a short name, an HF or budgetkv directory, a .gguf")
    ap.add_argument("--mode", required=True, choices=quantize.MODES,
                    help="int8: per-channel symmetric; int4: group-wise asymmetric, two weights per byte")
    ap.add_argument("--groupsize", type=int, default=None,
                    help=f"int4 only: in-features per scale/zero group, {', '.join(map(str, quantize.GROUP_SIZES))} "
                         f"(default {quantize.DEFAULT_GROUPSIZE}); must divide every Linear's in-features")
    ap.add_argument("--head", choices=["auto", "quantize", "float"], default="auto",
                    help="the output head: auto = quantized with int8, float (and tied where the model ties it) "
                         "with int4, where a 4-bit head costs far more quality than it saves")
    ap.add_argument("--out", type=Path, help="output directory (default: <checkpoint>-int8 or "
                                             "<checkpoint>-int4-g<groupsize> beside the checkpoint)")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress line (one goes to stderr only when it is a terminal and the work takes more "
                         "than a second, and is erased when it is done)")
    return ap.parse_args(argv)


def check_out(ckpt: Path, a) -> None:
    """--out (or its default) before any work: a directory this process can create or write, and never another
    checkpoint (quantize_dir would overwrite its config.json and weights)."""
    groupsize = a.groupsize or quantize.DEFAULT_GROUPSIZE if a.mode == "int4" else None
    out = a.out or quantize.default_out(ckpt, a.mode, groupsize)
    flag = "--out" if a.out else "the default --out"
    check_out_dir(out, flag)
    cfg = out / "config.json"
    if out.resolve() != ckpt.resolve() and cfg.is_file():
        try:
            theirs = read_json(cfg)
        except (OSError, ValueError):
            theirs = None
        if not isinstance(theirs, dict) or quantize.MARKER not in theirs:
            raise UserError(f"{flag} {out} holds a checkpoint that scripts/quantize.py did not write; pick another "
                            "directory (it would be overwritten)")


def run(a) -> int:
    progress.quiet = a.quiet
    ckpt = resolve_checkpoint(a.checkpoint)
    check_out(ckpt, a)
    r = quantize.quantize_dir(ckpt, a.mode, a.groupsize, a.head, a.out)
    groupsize = r["groupsize"]
    print(f"wrote {r['out']} ({a.mode}{f', group size {groupsize}' if groupsize else ''}, head "
          f"{'quantized' if r['head'] else 'float'}; weights {r['weight_bytes'] / 2**20:.1f} MiB)\n"
          f"run it: {run_command(r['out'])}", file=sys.stderr)
    return 0


def run_command(out) -> str:
    """generate.py on the checkpoint `out`, in this Python (the venv's): paths relative to the working directory
    where they are inside it."""
    def shown(path) -> str:
        path = Path(path).absolute()
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)
    return shlex.join([shown(sys.executable), shown(Path(__file__).parent.parent / "generate.py"), "--checkpoint",
                       shown(out)])


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

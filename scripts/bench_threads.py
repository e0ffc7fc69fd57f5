"""How the CPU threads should wait: generate.py's prefill and decode speed under each thread setting, with the
machine idle and with one busy process beside it, eager and compiled, each run a fresh `generate.py --json` (the
setting is read when torch loads OpenMP).

    python scripts/bench_threads.py [--prompt-bytes 6000] [--new-tokens 64] [--repeats 2] [--modes eager,compile]

Settings: `default` (what generate.py picks by itself: threads.py), `passive` (OMP_WAIT_POLICY=PASSIVE), `active`
(OMP_WAIT_POLICY=ACTIVE), `spin` (GOMP_SPINCOUNT=10000: spin briefly, then sleep), `1 thread` (--threads 1,
passive). "busy": `python -c "while True: pass"` runs beside each run. The prompt is the first bytes of LICENSE
(raw text, --no-chat), the policy KeyDiff at --budget 512. Runs alternate settings within each repeat, so that a
drift of the machine spreads over all of them. Prints one table of medians (tok/s) per mode."""
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli import Parser, run_child, run_cli, start_child, stop_child  # noqa: E402
from errors import UserError  # noqa: E402

SETTINGS = {"default": ({}, []), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
            "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, []), "spin": ({"GOMP_SPINCOUNT": "10000"}, []),
            "1 thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "1"])}
MODES = {"eager": [], "compile": ["--compile"]}


def run_generate(setting: str, mode: str, prompt: Path, a) -> dict:
    env_set, flags = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_set
    cmd = [sys.executable, str(REPO / "generate.py"), "--policy", "keydiff", "--budget", "512", "--prompt-file",
           str(prompt), "--no-chat", "--max-new-tokens", str(a.new_tokens), "--json", *flags, *MODES[mode]]
    r = run_child(cmd, env=env)
    if r.returncode != 0:
        raise UserError(f"{setting} {mode}: generate.py exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--prompt-bytes", type=int, default=6000, help="bytes of LICENSE in the prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode and setting (median)")
    ap.add_argument("--modes", default="eager,compile", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated thread settings to time")
    return ap


def main(argv=None) -> int:
    return run_cli(run, parser().parse_args(argv))


def run(a) -> int:
    modes, settings = a.modes.split(","), a.settings.split(",")
    if a.repeats < 1 or a.prompt_bytes < 1 or a.new_tokens < 1:
        raise UserError("--repeats, --prompt-bytes and --new-tokens must be >= 1")
    if bad := [m for m in modes if m not in MODES] + [s for s in settings if s not in SETTINGS]:
        raise UserError(f"unknown mode or setting {bad[0]!r} (modes {list(MODES)}, settings {list(SETTINGS)})")
    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.2f}: the 'idle' rows are not idle", file=sys.stderr)
    results = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt:
        prompt.write((REPO / "LICENSE").read_text()[:a.prompt_bytes])
        prompt.flush()
        for mode in modes:  # one untimed run per mode and setting first: compiles and caches what it needs
            for s in settings:
                run_generate(s, mode, Path(prompt.name), a)
        for load in ("idle", "busy"):
            spinner = start_child([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                for _ in range(a.repeats):
                    for mode in modes:
                        for s in settings:
                            st = run_generate(s, mode, Path(prompt.name), a)
                            row = results.setdefault((mode, s, load), {"prefill": [], "decode": []})
                            row["prefill"].append(st["prefill_tok_s"])
                            row["decode"].append(st["decode_tok_s"])
                            print(f"{mode} {s} {load}: prefill {st['prefill_tok_s']:.0f} decode "
                                  f"{st['decode_tok_s']:.1f} tok/s", file=sys.stderr)
            finally:
                if spinner is not None:
                    stop_child(spinner)
    for mode in modes:
        print(f"\n{mode} (tok/s, median of {a.repeats}; KeyDiff 512, {a.new_tokens} new tokens)\n")
        print("| setting | idle prefill | idle decode | busy prefill | busy decode |")
        print("|---|---:|---:|---:|---:|")
        for s in settings:
            cells = [f"{statistics.median(results[(mode, s, load)][k]):.1f}"
                     for load in ("idle", "busy") for k in ("prefill", "decode")]
            print(f"| {s} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

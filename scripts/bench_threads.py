"""How many CPU threads, and how they wait: generate.py's decode (and prefill) speed under each thread setting, in
each way a user starts a run, each run a fresh process.

    python scripts/bench_threads.py [--prompt-bytes 6000] [--new-tokens 64] [--repeats 2] [--modes eager,compile]

Settings: `default` (what a run does by itself: runtime.THREADS, adaptive), `active` (every core, spinning:
OMP_WAIT_POLICY=ACTIVE, the best idle setting), `passive` (every core, OMP_WAIT_POLICY=PASSIVE), `1 thread`
(--threads 1). Cases: `file` (stdout to a file), `pipe` (`generate.py --json | python3 -c "..."` reading the JSON),
`api` (`import torch, engine` then `engine.generate_text`: torch loaded first), `busy` (a `while True: pass`
process started before the run), `busy later` (started 2 s into it). The prompt is the first bytes of LICENSE
(raw text, --no-chat), KeyDiff at budget 512. Settings alternate within each repeat, so that a drift of the
machine spreads over all of them. Prints one table of median decode tok/s per mode, and each case's default against
its target: idle cases >= 0.9x the best setting's, busy ones >= 0.9x `1 thread`."""
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli import Parser, run_child, run_cli, start_child, stop_child  # noqa: E402
from errors import UserError  # noqa: E402

SETTINGS = {"default": ({}, []), "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, ["--threads", "0"]),
            "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "0"]), "1 thread": ({}, ["--threads", "1"])}
CASES = ("file", "pipe", "api", "busy", "busy later")
MODES = {"eager": [], "compile": ["--compile"]}
SPIN = [sys.executable, "-c", "while True: pass"]  # a busy process
CONSUMER = "import json, sys; print(json.dumps(json.load(sys.stdin)))"  # a pipeline's other end
API = """import sys, json, torch
sys.path.insert(0, {repo!r})
import engine
r = engine.generate_text(open({prompt!r}).read(), policy="keydiff", budget=512, max_new_tokens={n},
                         chat_template=False, compile={compile})
print(json.dumps({{k: v for k, v in r.items() if k != "token_ids"}}))"""


def command(setting: str, mode: str, case: str, prompt: Path, a) -> tuple[list[str], dict]:
    """(argv, environment) of one run."""
    env_set, flags = SETTINGS[setting]
    flags = [str(os.cpu_count()) if f == "0" else f for f in flags]  # every core
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env |= env_set | ({"OMP_NUM_THREADS": flags[1]} if case == "api" and flags else {})
    if case == "api":
        code = API.format(repo=str(REPO), prompt=str(prompt), n=a.new_tokens, compile=mode == "compile")
        return [sys.executable, "-c", code], env
    return [sys.executable, str(REPO / "generate.py"), "--policy", "keydiff", "--budget", "512", "--prompt-file",
            str(prompt), "--no-chat", "--max-new-tokens", str(a.new_tokens), "--json", *flags, *MODES[mode]], env


def run_generate(setting: str, mode: str, case: str, prompt: Path, a) -> dict:
    """One run's stats (its JSON, through a pipe to a second process for the `pipe` case)."""
    cmd, env = command(setting, mode, case, prompt, a)
    if case == "pipe":
        cmd = ["bash", "-c", f"{shlex.join(cmd)} | {shlex.join([sys.executable, '-c', CONSUMER])}"]
    spinners, timer = [], None
    if case == "busy":
        spinners.append(start_child(SPIN))
    if case == "busy later":
        timer = threading.Timer(2.0, lambda: spinners.append(start_child(SPIN)))
        timer.start()
    try:
        r = run_child(cmd, env=env)
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
        for p in spinners:
            stop_child(p)
    if r.returncode != 0:
        raise UserError(f"{setting} {mode} {case}: the run exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("--prompt-bytes", type=int, default=6000, help="bytes of LICENSE in the prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting and case (median)")
    ap.add_argument("--modes", default="eager,compile", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated thread settings to time")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated ways a run starts")
    return ap


def main(argv=None) -> int:
    return run_cli(run, parser().parse_args(argv))


def run(a) -> int:
    modes, settings, cases = a.modes.split(","), a.settings.split(","), a.cases.split(",")
    if a.repeats < 1 or a.prompt_bytes < 1 or a.new_tokens < 1:
        raise UserError("--repeats, --prompt-bytes and --new-tokens must be >= 1")
    bad = [m for m in modes if m not in MODES] + [s for s in settings if s not in SETTINGS] + \
        [c for c in cases if c not in CASES]
    if bad:
        raise UserError(f"unknown mode, setting or case {bad[0]!r} (modes {list(MODES)}, settings {list(SETTINGS)}, "
                        f"cases {list(CASES)})")
    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.2f}: the idle cases are not idle", file=sys.stderr)
    results = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt:
        prompt.write((REPO / "LICENSE").read_text()[:a.prompt_bytes])
        prompt.flush()
        for mode in modes:  # one untimed run per mode and setting first: compiles and caches what it needs
            for s in settings:
                run_generate(s, mode, "file", Path(prompt.name), a)
        for _ in range(a.repeats):
            for case in cases:
                for mode in modes:
                    for s in settings:
                        st = run_generate(s, mode, case, Path(prompt.name), a)
                        results.setdefault((mode, s, case), []).append(st)
                        print(f"{mode} {s} {case}: decode {st['decode_tok_s']:.1f} tok/s, threads {st['threads']} "
                              f"({st['thread_policy']}, {len(st['thread_changes'])} changes)", file=sys.stderr)
    for mode in modes:
        print(f"\n{mode}: decode tok/s, median of {a.repeats} (KeyDiff 512, {a.new_tokens} new tokens; "
              f"{time.strftime('%Y-%m-%d')})\n")
        print("| setting | " + " | ".join(cases) + " |")
        print("|---|" + "---:|" * len(cases))
        med = {(s, c): statistics.median(x["decode_tok_s"] for x in results[(mode, s, c)])
               for s in settings for c in cases}
        for s in settings:
            print(f"| {s} | " + " | ".join(f"{med[(s, c)]:.1f}" for c in cases) + " |")
        if "default" in settings:
            for c in cases:
                ref = "1 thread" if c.startswith("busy") else max((x for x in settings if x != "default"),
                                                                   key=lambda x: med[(x, c)], default=None)
                if ref in settings:
                    ratio = med[("default", c)] / med[(ref, c)]
                    print(f"{mode} {c}: default / {ref} = {ratio:.2f} ({'meets' if ratio >= 0.9 else 'misses'} "
                          f"0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many CPU threads, and how they wait: generate.py's decode (and prefill) speed under each thread setting, in
each way a user starts a run, each run a fresh process.

    python scripts/bench_threads.py [--prompt-bytes 6000] [--new-tokens 64] [--repeats 2] [--modes eager,compile]

Settings: `default` (what a run does by itself: runtime.THREADS, adaptive), `active` (every core, spinning:
OMP_WAIT_POLICY=ACTIVE, the best idle setting), `passive` (every core, OMP_WAIT_POLICY=PASSIVE), `1 thread`
(--threads 1). Cases: `file` (stdout to a file), `pipe` (`generate.py --json | python3 -c "..."` reading the JSON),
`loop` (the second run of a shell loop, `for i in 1 2; do generate.py ... > $i.json; done`), `api` (`import torch,
engine` then `engine.generate_text`: torch loaded first), `pytest` (the API call inside a test, under pytest's
capture), `quota` (a container's CPU quota of one core: a cgroup of its own, bound over /sys/fs/cgroup/cpu in a
mount namespace; needs root and a writable cgroup v1 cpu controller, else the case is left out with a line),
`busy` (a `while True: pass` process started before the run), `busy later` (started 2 s into it), `busy ends`
(started before it, stopped 2 s into it). The prompt is the first bytes of LICENSE (raw text, --no-chat), KeyDiff at
budget 512. Settings alternate within each repeat, so that a drift of the machine spreads over all of them. Prints
one table of median decode tok/s per mode, and each case's default against its target: idle cases >= 0.9x the best
setting's, `busy` and `busy later` >= 0.9x `1 thread`."""
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from cli import Parser, run_cli, start_child, stop_child  # noqa: E402
from errors import UserError  # noqa: E402

SETTINGS = {"default": ({}, []), "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, ["--threads", "0"]),
            "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "0"]), "1 thread": ({}, ["--threads", "1"])}
CASES = ("file", "pipe", "loop", "api", "pytest", "quota", "busy", "busy later", "busy ends")
BUSY = ("busy", "busy later")  # the cases whose target is `1 thread`'s speed
MODES = {"eager": [], "compile": ["--compile"]}
SPIN = [sys.executable, "-c", "while True: pass"]  # a busy process
CONSUMER = "import json, sys; print(json.dumps(json.load(sys.stdin)))"  # a pipeline's other end
API = """import sys, json, torch
sys.path.insert(0, {repo!r})
import engine
r = engine.generate_text(open({prompt!r}).read(), policy="keydiff", budget=512, max_new_tokens={n},
                         chat_template=False, compile={compile})
print(json.dumps({{k: v for k, v in r.items() if k != "token_ids"}}))"""
PYTEST = """import json, sys
sys.path.insert(0, {repo!r})
import engine


def test_generate():
    r = engine.generate_text(open({prompt!r}).read(), policy="keydiff", budget=512, max_new_tokens={n},
                             chat_template=False, compile={compile})
    with open({out!r}, "w") as f:
        json.dump({{k: v for k, v in r.items() if k != "token_ids"}}, f)
"""
CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, where a container's quota is read
IN_QUOTA = 'echo $$ > "$1/cgroup.procs" && mount --bind "$1" {root} && shift && exec "$@"'.format(root=CGROUP)


def quota_group() -> tuple[Path | None, str]:
    """(a cgroup of this machine's cpu controller with a quota of one core, made for the `quota` case; None and why
    where it cannot be made)."""
    group = CGROUP / f"budgetkv-bench-{os.getpid()}"
    if shutil.which("unshare") is None:
        return None, "no unshare command"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        return None, f"cannot make a cgroup with a CPU quota in {CGROUP} ({e.strerror or e})"
    return group, ""


def command(setting: str, mode: str, case: str, prompt: Path, a) -> tuple[list[str], dict]:
    """(argv, environment) of one run."""
    env_set, flags = SETTINGS[setting]
    flags = [str(os.cpu_count()) if f == "0" else f for f in flags]  # every core
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env |= env_set
    if case in ("api", "pytest"):
        env |= {"OMP_NUM_THREADS": flags[1]} if flags else {}
        fields = dict(repo=str(REPO), prompt=str(prompt), n=a.new_tokens, compile=mode == "compile")
        if case == "api":
            return [sys.executable, "-c", API.format(**fields)], env
        test = prompt.with_name("test_bench_threads_run.py")
        test.write_text(PYTEST.format(**fields, out=str(prompt.with_suffix(".json"))))
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], env
    return [sys.executable, str(REPO / "generate.py"), "--policy", "keydiff", "--budget", "512", "--prompt-file",
            str(prompt), "--no-chat", "--max-new-tokens", str(a.new_tokens), "--json", *flags, *MODES[mode]], env


def run_generate(setting: str, mode: str, case: str, prompt: Path, a, group: Path | None = None) -> dict:
    """One run's stats: its JSON (through a pipe to a second process for `pipe`; the file the second run of the
    loop or the test wrote for `loop` and `pytest`)."""
    cmd, env = command(setting, mode, case, prompt, a)
    written = prompt.with_suffix(".json")
    written.unlink(missing_ok=True)
    if case == "pipe":
        cmd = ["bash", "-c", f"{shlex.join(cmd)} | {shlex.join([sys.executable, '-c', CONSUMER])}"]
    if case == "loop":
        cmd = ["bash", "-c", f'for i in 1 2; do {shlex.join(cmd)} > "$0"; done', str(written)]
    if case == "quota":
        cmd = ["unshare", "-m", "bash", "-c", IN_QUOTA, "in-quota", str(group), *cmd]
    # Every child is started and stopped from this (the main) thread: a child dies with the thread that started it
    # (files.dies_with_parent), and a timer's thread ends at once.
    spinners = [start_child(SPIN)] if case in ("busy", "busy ends") else []
    try:
        with start_child(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
            try:
                if case in ("busy later", "busy ends"):
                    try:
                        p.wait(2.0)
                    except subprocess.TimeoutExpired:  # 2 s into the run
                        if case == "busy later":
                            spinners.append(start_child(SPIN))
                        else:
                            stop_child(spinners.pop())
                out, err = p.communicate()
            except BaseException:
                stop_child(p)
                raise
    finally:
        for spinner in spinners:
            stop_child(spinner)
    if p.returncode != 0:
        raise UserError(f"{setting} {mode} {case}: the run exited {p.returncode}: "
                        f"{(err.strip() or out.strip())[-300:]}")
    return json.loads(written.read_text() if case in ("loop", "pytest") else out.strip().splitlines()[-1])


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
    if "pytest" in cases and subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True).returncode:
        raise UserError("the pytest case needs pytest in this Python (bash scripts/setup.sh test), or leave it out "
                        "with --cases")
    group = None
    if "quota" in cases:
        group, why = quota_group()
        if group is None:
            print(f"note: the quota case is left out: {why} (it needs root)", file=sys.stderr)
            cases.remove("quota")
    try:
        results = measure(modes, settings, cases, a, group)
    finally:
        if group is not None:
            try:
                group.rmdir()
            except OSError as e:  # a process still in it: the folder stays, named
                print(f"note: cannot remove the cgroup {group}: {e.strerror}", file=sys.stderr)
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
                ref = "1 thread" if c in BUSY else max((x for x in settings if x != "default"),
                                                                   key=lambda x: med[(x, c)], default=None)
                if ref in settings:
                    ratio = med[("default", c)] / med[(ref, c)]
                    print(f"{mode} {c}: default / {ref} = {ratio:.2f} ({'meets' if ratio >= 0.9 else 'misses'} "
                          f"0.9)")
    return 0


def measure(modes: list[str], settings: list[str], cases: list[str], a, group: Path | None) -> dict:
    """{(mode, setting, case): [each repeat's stats]}."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="budgetkv-threads-") as tmp:
        prompt = Path(tmp) / "prompt.txt"
        prompt.write_text((REPO / "LICENSE").read_text()[:a.prompt_bytes])
        for mode in modes:  # one untimed run per mode and setting first: compiles and caches what it needs
            for s in settings:
                run_generate(s, mode, "file", prompt, a)
        for _ in range(a.repeats):
            for case in cases:
                for mode in modes:
                    for s in settings:
                        st = run_generate(s, mode, case, prompt, a, group)
                        results.setdefault((mode, s, case), []).append(st)
                        print(f"{mode} {s} {case}: decode {st['decode_tok_s']:.1f} tok/s, threads {st['threads']} "
                              f"({st['thread_policy']}, {len(st['thread_changes'])} changes)", file=sys.stderr)
    return results


if __name__ == "__main__":
    sys.exit(main())

"""Long work survives interruption: scripts/eval.py keeps each finished configuration in results.jsonl and --resume
runs only the rest (the final results equal an uninterrupted run's); scripts/bench.py does the same with its JSON
output (its configurations are child processes, faked here); a resume against other settings is refused in one line;
outputs are replaced whole, never left half-written (a full disk simulated with RLIMIT_FSIZE)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
from conftest import REPO

from errors import UserError
from scripts import bench, bench_figure, bench_quant, benchlib
from scripts import eval as ev
from scripts import eval_journal, eval_report

pytestmark = pytest.mark.usefixtures("one_thread")

# 2 tasks x (full + 2 policies x 2 budgets) = 10 configurations, a few seconds on the tiny model
EVAL_ARGS = ["--tasks", "fidelity,passkey", "--policies", "full,sink,keydiff", "--budgets", "32,64", "--lengths", "200",
             "--fid-prefix", "64", "--fid-tokens", "8", "--block-size", "16", "--max-new-tokens", "4",
             "--device", "cpu"]


@pytest.fixture(scope="module")
def ckpt(hf_tiny, tmp_path_factory):
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    return with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_resume"),
                               "the quick brown fox jumps over the lazy dog 0123456789")


def eval_argv(ckpt, out, *extra):
    return ["--checkpoint", str(ckpt), "--out-dir", str(out), *EVAL_ARGS, *extra]


@pytest.fixture(scope="module")
def uninterrupted(ckpt, tmp_path_factory, one_thread):
    """results.json of one uninterrupted run, and its folder."""
    out = tmp_path_factory.mktemp("eval_full")
    assert ev.main(eval_argv(ckpt, out)) == 0
    return json.loads((out / "results.json").read_text()), out


def journal(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_eval_resume_runs_only_the_rest(ckpt, uninterrupted, tmp_path, monkeypatch, capsys):
    full, _ = uninterrupted
    out = tmp_path / "eval"
    append = ev.append_line
    written = []

    def stop_after_third(path, entry):  # interrupted (Ctrl-C) right after the 3rd configuration is on disk
        append(path, entry)
        written.append(entry)
        if len(written) == 2:  # (the first configuration starts the journal; these are the 2nd and 3rd)
            raise KeyboardInterrupt
    monkeypatch.setattr(ev, "append_line", stop_after_third)
    assert ev.main(eval_argv(ckpt, out)) == 130
    lines = journal(out)
    assert len(lines) == 1 + 3 and "settings" in lines[0] and not (out / "results.json").exists()
    first = [(e["task"], e["policy"], e["budget"]) for e in lines[1:]]

    ran = []
    monkeypatch.setattr(ev, "append_line", lambda path, entry: (ran.append(entry), append(path, entry)))
    capsys.readouterr()
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 0
    assert "--resume: 3 of 10 configurations" in capsys.readouterr().err
    assert len(ran) == 7 and not {(e["task"], e["policy"], e["budget"]) for e in ran} & set(first)
    res = json.loads((out / "results.json").read_text())
    assert res["records"] == full["records"] and res["summary"] == full["summary"] and res["resumed"] == 3
    table = lambda md: [line for line in md.read_text().splitlines() if line.startswith("|")]  # noqa: E731
    assert table(out / "results.md") == table(uninterrupted[1] / "results.md")

    # everything there: no model is loaded, nothing runs, the same results
    monkeypatch.setattr(ev, "load_model", lambda *a: pytest.fail("loaded a model with nothing to run"))
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 0
    assert json.loads((out / "results.json").read_text())["records"] == full["records"]


def test_eval_resume_after_sigkill(ckpt, uninterrupted, tmp_path):
    """SIGKILL once the journal holds a configuration (maybe mid-line); --resume finishes with the same results."""
    full, _ = uninterrupted
    out = tmp_path / "eval"
    p = subprocess.Popen([sys.executable, str(REPO / "scripts" / "eval.py"), *eval_argv(ckpt, out), "--threads", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = out / "results.jsonl"
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline:
        if path.exists() and path.read_text().count("\n") >= 2:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not (out / "results.json").exists()
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 0
    assert json.loads((out / "results.json").read_text())["records"] == full["records"]


def test_eval_resume_drops_a_line_cut_short_and_adds_new_configurations(ckpt, uninterrupted, tmp_path, monkeypatch):
    full, done = uninterrupted
    out = tmp_path / "eval"
    out.mkdir()
    lines = (done / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:5]) + lines[5][:40])  # killed while writing line 6
    ran = []
    append = ev.append_line
    monkeypatch.setattr(ev, "append_line", lambda path, entry: (ran.append(entry), append(path, entry)))
    # a policy more than the earlier run: its configurations run, the rest comes from the journal
    assert ev.main(eval_argv(ckpt, out, "--resume", "--policies", "full,sink,keydiff,tova")) == 0
    assert len(ran) == 10 - 4 + 4
    records = json.loads((out / "results.json").read_text())["records"]
    assert [r for r in records if r["policy"] != "tova"] == full["records"]
    text = (out / "results.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "256"], "lengths: [200] there, [256] now"),
    (["--seed", "1"], "seed: 0 there, 1 now"),
    (["--dtype", "bfloat16"], 'dtype: "torch.float32" there, "torch.bfloat16" now'),
    (["--fid-tokens", "9"], "fid_tokens: 8 there, 9 now"),
    (["--accept-k", "2"], "accept_k: 4 there, 2 now"),
])
def test_eval_resume_refuses_other_settings(ckpt, uninterrupted, tmp_path, capsys, extra, message):
    _, done = uninterrupted
    out = tmp_path / "eval"
    shutil.copytree(done, out)
    before = (out / "results.jsonl").read_bytes()
    assert ev.main(eval_argv(ckpt, out, "--resume", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0] and message in err[0], err
    assert (out / "results.jsonl").read_bytes() == before


def test_eval_resume_refuses_a_journal_from_before_the_acceptance_measure(ckpt, uninterrupted, tmp_path, capsys):
    """A journal written before --accept-k existed (no accept_k setting, no accept measure) is refused in one line
    that names it."""
    _, done = uninterrupted
    out = tmp_path / "eval"
    shutil.copytree(done, out)
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    del lines[0]["settings"]["accept_k"]
    for e in lines[1:]:
        for r in e["records"]:
            r.pop("accept", None)
    (out / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings (accept_k: null there, 4 now)" in err[0], err


@pytest.mark.parametrize("damage", ["nan", "inf", "no-records"])
def test_eval_resume_refuses_a_damaged_record(ckpt, uninterrupted, tmp_path, capsys, damage):
    """A journal line edited by hand (a measure that is not finite, records emptied) is refused, not summarised."""
    _, done = uninterrupted
    out = tmp_path / "eval"
    shutil.copytree(done, out)
    lines = (out / "results.jsonl").read_text().splitlines()
    entry = json.loads(lines[2])
    if damage == "no-records":
        entry["records"] = []
    else:
        measure = eval_report.measures(entry["task"])[0]
        entry["records"][0][measure] = float(damage)  # json.dumps writes NaN / Infinity
    lines[2] = json.dumps(entry)
    (out / "results.jsonl").write_text("\n".join(lines) + "\n")
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 3" in err[0] and "Traceback" not in err[0], err


def test_eval_resume_measures_again_a_line_edited_by_hand(ckpt, uninterrupted, tmp_path, capsys):
    """A journal line whose score was edited by hand (still well-formed) is measured again, with a line saying so:
    its edited score is not served as a result."""
    full, done = uninterrupted
    out = tmp_path / "eval"
    shutil.copytree(done, out)
    lines = (out / "results.jsonl").read_text().splitlines()
    n, entry = next((n, e) for n, e in enumerate(map(json.loads, lines)) if e.get("task") == "passkey" and
                    e.get("policy") == "sink")
    entry["records"][0]["score"] = 100.0 - entry["records"][0]["score"]
    lines[n] = json.dumps(entry)
    (out / "results.jsonl").write_text("\n".join(lines) + "\n")
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 0
    assert f"line {n + 1}: its content does not match its checksum" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["records"] == full["records"]


@pytest.mark.parametrize("field,value", [("policy", "sink"), ("budget", 64), ("protocol", "one-shot")])
def test_eval_resume_refuses_a_record_under_another_configuration(ckpt, uninterrupted, tmp_path, capsys, field,
                                                                  value):
    """A journal line whose records name another policy, budget or protocol than its key is refused in one line
    naming the line, not averaged into the key's cell."""
    _, done = uninterrupted
    out = tmp_path / "eval"
    shutil.copytree(done, out)
    lines = (out / "results.jsonl").read_text().splitlines()
    n, entry = next((n, e) for n, e in enumerate(map(json.loads, lines)) if e.get("policy") == "keydiff" and
                    e.get("budget") == 32)
    entry["records"][-1][field] = value
    lines[n] = json.dumps(entry)
    (out / "results.jsonl").write_text("\n".join(lines) + "\n")
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"line {n + 1}: a record of " in err[0] and "under keydiff (block, budget 32)" in err[0]


def test_eval_resume_refuses_another_checkpoint(ckpt, uninterrupted, tmp_path, capsys):
    """The same command on a checkpoint whose weights changed (same path) is another run."""
    _, done = uninterrupted
    other = tmp_path / "ckpt"
    shutil.copytree(ckpt, other)
    out = tmp_path / "eval"
    argv = eval_argv(other, out, "--tasks", "fidelity", "--policies", "full")  # one configuration
    assert ev.main(argv) == 0
    weights = other / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten in place
    capsys.readouterr()
    assert ev.main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings (checkpoint:" in err[0], err


def test_journal_lines_not_written_by_eval_are_refused(tmp_path):
    settings = {"seed": 0}
    path = tmp_path / "results.jsonl"
    head = json.dumps({"settings": settings}) + "\n"
    for line, message in [('{"run": "x", "task": 5}', "line 2: task is missing or of the wrong type"),
                          ("[1]", "line 2: not a JSON object"), ("{", "line 2 is not JSON"),
                          ('{"run": "x", "task": "fidelity", "protocol": "block", "policy": "full", "budget": null, '
                           '"data": "d", "records": [{"task": "fidelity", "kl": "0"}], "na": null}',
                           "line 2: a record is malformed")]:
        path.write_text(head + line + "\n")
        with pytest.raises(UserError, match=message):
            eval_journal.read_journal(path, settings)
    path.write_text(head + "{")  # a line cut short: dropped, not refused
    assert eval_journal.read_journal(path, settings) == {}


def test_bench_rows_not_written_by_bench_are_refused(tmp_path):
    settings, args = {"mode": "table"}, SimpleNamespace(resume=True)
    path = tmp_path / "b.json"
    edited = [dict(decode_tok_s="9"), dict(kvpress="x"), dict(kvpress={"decode_tok_s": 1.0}), dict(tokens=[1, "2"]),
              dict(decode_tok_s_repeats=5), dict(ttft_s=None), dict(protocol=True)]  # each a TypeError in the table
    for results in [[], {"sink": {"protocol": "block"}}] + [{"sink": fake_row("table", "sink") | e} for e in edited]:
        path.write_text(json.dumps({"settings": settings, "results": results}))
        with pytest.raises(UserError, match="has no results as this script writes them"):
            benchlib.previous(path, settings, args, "results", dict, bench.TABLE_FIELDS)
    good = benchlib.signed({"sink": dict(fake_row("table", "sink"), bandwidth_fraction=0.5)})  # as bench.py saves it
    path.write_text(json.dumps({"settings": settings, "results": good}))
    assert benchlib.previous(path, settings, args, "results", dict, bench.TABLE_FIELDS) == good


def test_eval_disk_full_keeps_whole_lines_then_resumes(ckpt, uninterrupted, tmp_path):
    """A file size limit (a full disk) stops the run part-way: whatever it wrote is whole lines, results.json is
    not there half-written, and --resume without the limit finishes with the uninterrupted run's results."""
    full, done = uninterrupted
    out = tmp_path / "eval"
    size = sum(map(len, (done / "results.jsonl").read_bytes().splitlines(True)[:6])) + 20  # the 7th line cut short
    limit = "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); " \
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({size}, {size})); "
    r = subprocess.run([sys.executable, "-c", limit + "import runpy, sys; sys.argv = sys.argv[1:]; "
                        "runpy.run_path(sys.argv[0], run_name='__main__')", str(REPO / "scripts" / "eval.py"),
                        *eval_argv(ckpt, out), "--threads", "1"], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr[-2000:]
    text = (out / "results.jsonl").read_text()
    kept = [json.loads(line) for line in text.split("\n")[:-1]]  # whole lines parse; a tail cut short is dropped
    assert len(kept) == 6 and not text.endswith("\n") and not (out / "results.json").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".budgetkv-tmp-")]
    assert ev.main(eval_argv(ckpt, out, "--resume")) == 0
    assert json.loads((out / "results.json").read_text())["records"] == full["records"]
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and len(lines) == 1 and "results.jsonl" in lines[0], r.stderr


def test_write_atomic_under_a_full_disk(tmp_path):
    """write_atomic leaves the old file whole (and no temporary file) when the new one cannot be written."""
    path = tmp_path / "out.json"
    path.write_text("old")
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); sys.path.insert(0, sys.argv[2]); "
            "from pathlib import Path; from scripts.outputs import write_atomic\n"
            "from errors import EnvironmentFailure\n"
            "try:\n    write_atomic(Path(sys.argv[1]), 'x' * 5000)\nexcept EnvironmentFailure as e:\n"
            "    sys.exit(27 if 'File too large' in str(e) else 1)")
    r = subprocess.run([sys.executable, "-c", code, str(path), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 27, r.stderr  # EFBIG: File too large
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


# ------------------------------------------------------------------------------------------------------ bench.py

def fake_row(kind, what):
    """What a configuration's child process prints, deterministic per configuration."""
    x = 1.0 + sum(map(ord, what)) % 97 / 10
    if kind == "table":
        return dict(protocol="block", prefill_tok_s=100 * x, decode_step_ms=x, decode_tok_s=1e3 / x, warmup_s=0.1,
                    prefill_s=0.5, prefill_peak_mib=10 * x, decode_peak_mib=11 * x, kv_cache_mib=0.5,
                    bytes_per_step=1e6 * x, wall_s=1.0)
    if kind == "quant":
        return dict(mode=what, decode_tok_s=50 * x, bytes_per_step=1e6 * x, prefill_tok_s=100 * x, ppl=10 * x,
                    decode_peak_mib=11 * x, kernels="fake", wall_s=1.0, nll=2.0)
    label, T = what.split("@")
    return dict(label=label, T=int(T), N=8, cache_slots=64, prefill_s=0.1, warmup_s=0.1, decode_s=0.1,
                decode_step_ms=x, decode_peak_mib=10 * x, weights_mib=1.0, cache_mib=x, bytes_per_step=1e6 * x,
                params=None, wall_s=1.0)


BENCH_RUNS = {  # kind -> (argv, the configurations in order, the flag naming one in a child's argv)
    "table": (["--policies", "sink,tova", "--json", "{out}"], ["no-evict", "full", "sink", "tova"], "--one"),
    "quant": (["--modes", "float32,bfloat16,int8", "--json", "{out}"], ["float32", "bfloat16", "int8"], "--one"),
    "figure": (["--contexts", "64,128", "--budgets", "16", "--out-dir", "{dir}"],
               ["full@64", "rocketkv-16@64", "full@128", "rocketkv-16@128"], "--one"),
}


def run_bench(monkeypatch, capsys, tmp_path, ckpt, argv, flag, kind, fail_on=None, out=False):
    """The script's main() in this process (bench.py; bench_quant.py for quant, bench_figure.py for figure); each
    configuration's child faked.
    (exit code, children started, stderr)"""
    module = {"quant": bench_quant, "figure": bench_figure}.get(kind, bench)
    started = []

    def fake_run(cmd, **kw):
        what = cmd[cmd.index(flag) + 1]
        started.append(what)
        if what == fail_on:
            return SimpleNamespace(returncode=1, stdout="", stderr="Traceback (most recent call last):\n"
                                   "RuntimeError: boom\n")
        return SimpleNamespace(returncode=0, stdout=json.dumps(fake_row(kind, what)) + "\n", stderr="")
    monkeypatch.setattr(benchlib, "run_child", fake_run)
    monkeypatch.setattr(module, "read_bandwidth_gb_s", lambda device: 10.0, raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))  # a failed child's log
    sizes = {"table": ["--prompt-tokens", "100", "--budget", "32"], "quant": ["--prompt-tokens", "100"], "figure": []}
    monkeypatch.setattr(sys, "argv", [module.__file__, "--checkpoint", str(ckpt), "--decode-steps", "8", "--threads",
                                      "1", "--device", "cpu", *sizes[kind], *argv])
    try:
        code = module.main()
    except SystemExit as e:
        code = e.code
    printed = capsys.readouterr()
    return (code, started, printed.err) + ((printed.out,) if out else ())


def uninterrupted_bench(kind, ckpt, tmp_path, monkeypatch, capsys):
    """One run of every configuration of `kind`: its output path, the argv maker for another output, the JSON."""
    argv, configs, flag = BENCH_RUNS[kind]
    out = tmp_path / "full" / "rocketkv_figure.json" if kind == "figure" else tmp_path / "full.json"
    fmt = lambda out: [a.format(out=out, dir=out.parent) for a in argv]  # noqa: E731
    code, started, _ = run_bench(monkeypatch, capsys, tmp_path, ckpt, fmt(out), flag, kind)
    assert code in (0, None) and started == configs
    return out, fmt, json.loads(out.read_text())


@pytest.mark.parametrize("kind", list(BENCH_RUNS))
def test_bench_resume_runs_only_the_rest(kind, ckpt, tmp_path, monkeypatch, capsys):
    _, configs, flag = BENCH_RUNS[kind]
    out, fmt, full = uninterrupted_bench(kind, ckpt, tmp_path, monkeypatch, capsys)

    part = tmp_path / "part" / out.name
    part.parent.mkdir()
    code, started, err = run_bench(monkeypatch, capsys, tmp_path, ckpt, fmt(part), flag, kind, fail_on=configs[2])
    assert code != 0 and started == configs[:3]
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: {configs[2].split('@')[0]}") and "RuntimeError: boom" in lines[-1]
    assert "Traceback" not in err
    saved = json.loads(part.read_text())
    assert len(saved["rows" if kind != "table" else "results"]) == 2

    code, started, _ = run_bench(monkeypatch, capsys, tmp_path, ckpt, fmt(part) + ["--resume"], flag, kind)
    assert code in (0, None) and started == configs[2:]
    resumed = json.loads(part.read_text())
    key = "results" if kind == "table" else "rows"
    assert resumed[key] == full[key] and resumed["settings"] == full["settings"]

    # other settings: refused in one line, the file untouched
    before = part.read_bytes()
    code, started, err = run_bench(monkeypatch, capsys, tmp_path, ckpt, fmt(part) + ["--resume", "--repeats", "2"],
                                   flag, kind)
    assert code == 2 and started == [] and part.read_bytes() == before
    assert err.strip().splitlines() == [err.strip()] and "repeats: 3 there, 2 now" in err, err


@pytest.mark.parametrize("kind", ["table", "figure"])
def test_a_single_sample_says_its_ratios_are_noise(kind, ckpt, tmp_path, monkeypatch, capsys):
    """--repeats 1: one line under the table says that each configuration was timed once and its overheads and ratios
    are noise; none with more samples."""
    argv, _, flag = BENCH_RUNS[kind]
    for repeats, notes in (("1", 1), ("3", 0)):
        path = tmp_path / repeats / "out.json"
        path.parent.mkdir()
        code, _, _, out = run_bench(monkeypatch, capsys, tmp_path, ckpt, [a.format(out=path, dir=path.parent)
                                                                          for a in argv] + ["--repeats", repeats],
                                    flag, kind, out=True)
        assert code in (0, None)
        lines = [line for line in out.splitlines() if "dominated by noise" in line]
        assert len(lines) == notes and all(line.startswith("note: --repeats 1 ") for line in lines), out


def test_write_atomic_removes_a_killed_writers_temporary_file(tmp_path):
    from files import TMP_PREFIX
    from scripts.outputs import write_atomic
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{TMP_PREFIX}{int(dead.stdout)}-out.json"  # a writer killed between its write and its rename
    stale.write_text("half")
    write_atomic(tmp_path / "out.json", "new")
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"] and (tmp_path / "out.json").read_text() == "new"


@pytest.mark.parametrize("kind", list(BENCH_RUNS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
def test_bench_resume_measures_again_a_row_that_is_not_a_measurement(kind, value, ckpt, tmp_path, monkeypatch,
                                                                     capsys):
    """A kept row whose timing is NaN, infinite, negative or 0 (edited, or written by a broken run; the tables divide
    by it) is measured again, with one line naming it; the other rows are kept, and the output equals an
    uninterrupted run's."""
    _, configs, flag = BENCH_RUNS[kind]
    out, fmt, full = uninterrupted_bench(kind, ckpt, tmp_path, monkeypatch, capsys)
    key = "results" if kind == "table" else "rows"
    damaged = json.loads(out.read_text())
    row = damaged[key][configs[1]] if kind == "table" else damaged[key][1]
    field = "decode_tok_s" if kind == "quant" else "decode_step_ms"  # a timing the table is made of
    row[field] = value
    out.write_text(json.dumps(damaged))  # json.dumps writes NaN / Infinity, as a broken run would
    code, started, err = run_bench(monkeypatch, capsys, tmp_path, ckpt, fmt(out) + ["--resume"], flag, kind)
    assert code in (0, None) and started == [configs[1]]
    named = {"table": "full", "quant": "mode bfloat16", "figure": "label rocketkv-16, T 64"}[kind]
    lines = [line for line in err.splitlines() if "measuring it again" in line]
    assert lines == [f"--resume: {out}: {named} has {field} = {value} (not a measurement: a finite number > 0): "
                     "measuring it again"], err
    assert json.loads(out.read_text())[key] == full[key]


@pytest.mark.parametrize("kind", list(BENCH_RUNS))
def test_bench_resume_measures_again_a_row_edited_by_hand(kind, ckpt, tmp_path, monkeypatch, capsys):
    """A kept row edited by hand to another plausible timing (still a finite number > 0) no longer matches its
    checksum: measured again, with one line naming it; the output equals an uninterrupted run's."""
    _, configs, flag = BENCH_RUNS[kind]
    out, fmt, full = uninterrupted_bench(kind, ckpt, tmp_path, monkeypatch, capsys)
    key = "results" if kind == "table" else "rows"
    edited = json.loads(out.read_text())
    row = edited[key][configs[1]] if kind == "table" else edited[key][1]
    field = "decode_tok_s" if kind == "quant" else "decode_step_ms"
    row[field] *= 2
    out.write_text(json.dumps(edited))
    code, started, err = run_bench(monkeypatch, capsys, tmp_path, ckpt, fmt(out) + ["--resume"], flag, kind)
    assert code in (0, None) and started == [configs[1]]
    lines = [line for line in err.splitlines() if "measuring it again" in line]
    assert len(lines) == 1 and "does not match its checksum" in lines[0], err
    assert json.loads(out.read_text())[key] == full[key]


def test_a_journal_line_never_goes_through_a_link(tmp_path):
    """eval.py's journal after its first (atomic) write: a link planted at its name is refused, its target
    untouched; a plain journal gets whole lines."""
    from scripts.outputs import append_line
    victim, link = tmp_path / "victim", tmp_path / "results.jsonl"
    victim.write_text("mine\n")
    link.symlink_to(victim)
    with pytest.raises(OSError, match="results.jsonl"):
        append_line(link, {"a": 1})
    assert victim.read_text() == "mine\n" and link.is_symlink()
    link.unlink()
    os.link(victim, link)  # a hard link planted at its name: refused too
    with pytest.raises(UserError, match="results.jsonl has other hard links"):
        append_line(link, {"a": 1})
    assert victim.read_text() == "mine\n"
    plain = tmp_path / "plain.jsonl"
    append_line(plain, {"a": 1})
    append_line(plain, {"b": 2})
    assert [json.loads(x) for x in plain.read_text().splitlines()] == [{"a": 1}, {"b": 2}]


def test_a_journal_past_the_resume_limit_is_refused_unread(tmp_path):
    """A sparse results.jsonl of a few bytes on disk that says it is gigabytes (truncate -s) is refused in one line
    naming it, as every other resume file is past files.JSON_MAX_BYTES (errors.md), not read into memory whole."""
    import files
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"settings": {"seed": 0}}) + "\n")
    os.truncate(path, 8 << 30)  # 8 GiB of zeros, none of them on disk
    with pytest.raises(UserError, match=r"results.jsonl is larger than 64 MiB") as e:
        eval_journal.read_journal(path, {"seed": 0})
    assert "\n" not in str(e.value)
    os.truncate(path, files.JSON_MAX_BYTES)  # at the limit: read (the zeros after the last newline: a line cut short)
    assert eval_journal.read_journal(path, {"seed": 0}) == {}


def test_bench_kvpress_ids_file_never_goes_through_a_link(tmp_path, monkeypatch):
    """bench.py --kvpress hands the prompt's ids to its kvpress run in build/bench_ids.json: written whole under a
    temporary name (as every other output), a link planted at that name replaced, what it points to untouched."""
    (tmp_path / ".venv-kv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-kv" / "bin" / "python").write_text("")
    (tmp_path / "build").mkdir()
    victim, link = tmp_path / "victim", tmp_path / "build" / "bench_ids.json"
    victim.write_text("mine\n")
    link.symlink_to(victim)
    monkeypatch.setattr(bench, "REPO", tmp_path)
    seen = []
    monkeypatch.setattr(bench, "run_child", lambda cmd, **kw: seen.append(json.loads(link.read_text())) or
                        subprocess.CompletedProcess(cmd, 1, "", "no kvpress here"))
    args = SimpleNamespace(random_weights=False, decode_steps=1, repeats=1, dtype="float32", device="cpu")
    assert bench.run_kvpress(tmp_path, [5, 6, 7], "keydiff", 64, args) is None
    assert victim.read_text() == "mine\n" and not link.is_symlink() and seen == [[5, 6, 7]]

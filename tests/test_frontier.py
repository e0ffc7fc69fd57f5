"""scripts/frontier.py on a tiny random Llama: its rows (quality from eval.py's own functions, equal to eval.py's
run of the command it names; speed from bench.py --one, whose own line the row holds; KV bytes by hand), the Pareto
front (on hand-made points and on the run's rows: no dominated configuration on it), the table and the PNG, the
progress line per configuration, --random-weights, and --resume after Ctrl-C, SIGKILL and a row edited to garbage.
bench.py's processes are faked except in one test, which runs them."""
import contextlib
import io
import json
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

from scripts import eval as ev
from scripts import frontier as fr

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH, BLOCK, STEPS = 300, 16, 4
ARGS = ["--length", str(LENGTH), "--budgets", "32,64", "--policies", "full,sink,keydiff,snapkv++", "--fid-tokens", "8",
        "--block-size", str(BLOCK), "--decode-steps", str(STEPS), "--repeats", "1", "--depths", "0,1", "--eager",
        "--threads", "1", "--device", "cpu"]
LABELS = ["full", "sink@32", "sink@64", "keydiff@32", "keydiff@64", "snapkv++@32", "snapkv++@64"]
NA = "snapkv++@32"  # keeps 32 - 5 new tokens < its 32-token observation window


@pytest.fixture(scope="module")
def ckpt(hf_tiny, tmp_path_factory):
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    return with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_frontier"),
                               "the quick brown fox jumps over the lazy dog 0123456789")


def fake_row(spec: str, budget: int) -> dict:
    """What bench.py --one prints, deterministic per configuration."""
    x = 1 + sum(map(ord, spec)) % 17 / 10 + budget / 1000
    return dict(protocol="block", decode_tok_s=100 * x, decode_step_ms=10 / x, ttft_s=0.1 * x, prefill_tok_s=900 * x,
                prefill_peak_mib=200 + x, decode_peak_mib=210 + x, kv_cache_mib=0.5, warmup_s=0.01, wall_s=1.0)


def fake_bench(monkeypatch) -> list:
    """bench.py's processes faked; the configurations they were started for, in order."""
    started = []

    def run_child(cmd):
        spec, budget = cmd[cmd.index("--one") + 1], int(cmd[cmd.index("--budget") + 1])
        started.append(spec if spec in ("full", "exact-topk") else f"{spec}@{budget}")
        return subprocess.CompletedProcess(cmd, 0, json.dumps(fake_row(spec, budget)) + "\n", "")
    monkeypatch.setattr(fr, "run_child", run_child)
    return started


def run(argv, capsys) -> tuple[int, str]:
    code = fr.main(argv)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def uninterrupted(ckpt, tmp_path_factory, one_thread):
    """One run of every configuration (bench.py faked): its folder, frontier.json and its progress lines."""
    out = tmp_path_factory.mktemp("frontier")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        started = fake_bench(mp)
        assert fr.main(["--checkpoint", str(ckpt), "--out-dir", str(out), *ARGS]) == 0
    assert started == [x for x in LABELS if x != NA]  # n/a: no process
    lines = [line for line in err.getvalue().splitlines() if line.startswith("[")]
    return out, json.loads((out / "frontier.json").read_text()), lines


def argv(ckpt, out, *extra):
    return ["--checkpoint", str(ckpt), "--out-dir", str(out), *ARGS, *extra]


@pytest.fixture
def no_plots(monkeypatch):
    """frontier.md without frontier.png (tested above): matplotlib not found."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))


def dominated(p, points) -> bool:
    return any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in points)


# ------------------------------------------------------------------------------------------------------ the front

def test_front_of_hand_made_points():
    """(cost, value): less cost and more value dominate; a point with the same cost and less value, or more cost and
    no more value, is off the front; equal points both stay on it."""
    pts = [(1, 50), (2, 60), (2, 55), (3, 60), (4, 100), (1, 50), (0.5, 10), (5, 90)]
    assert fr.pareto_front(pts) == [0, 1, 4, 5, 6]
    assert fr.pareto_front([]) == [] and fr.pareto_front([(3, 1)]) == [0]
    rng = random.Random(0)
    for _ in range(50):
        pts = [(rng.randint(1, 8), rng.randint(0, 8)) for _ in range(rng.randint(1, 12))]
        on = set(fr.pareto_front(pts))
        for i, p in enumerate(pts):
            assert (i in on) == (not dominated(p, pts)), (pts, i)


# ---------------------------------------------------------------------------------------------------- the rows

def test_rows_front_table_and_png(ckpt, uninterrupted):
    from scripts.benchlib import make_document
    from tokenizer import load_tokenizer
    out, res, lines = uninterrupted
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == LABELS and res["measured"] == {"quality": True, "speed": True}
    full = rows["full"]
    assert full["kl"] == 0 and full["top1"] == 1 and full["protocol"] == "block"
    assert rows["snapkv++@64"]["protocol"] == "one-shot" and "observation window" in rows[NA]["na"]
    # K and V, fp32: 2 layers x 2 KV heads x 16 dims x (budget + block) slots x 4 bytes x 2
    for b in (32, 64):
        assert rows[f"sink@{b}"]["kv_mib"] == rows[f"keydiff@{b}"]["kv_mib"] == 2 * 2 * 16 * (b + BLOCK) * 8 / 2**20
    prompt = make_document(load_tokenizer(ckpt), LENGTH)[1]  # bench.py's prompt; full holds it and the new tokens
    assert full["kv_mib"] == 2 * 2 * 16 * (len(prompt) + 1 + STEPS + BLOCK) * 8 / 2**20
    for label, r in rows.items():
        if r["na"] is None:  # the speed columns are bench.py --one's own line
            spec, budget = label.partition("@")[::2]
            bench = fake_row(spec, int(budget or 64))  # (full is given the largest budget, and ignores it)
            assert all(r[k] == bench[k] for k in fr.SPEED), label
            assert (r["kl"] > 0) == (label != "full") and 0 <= r["top1"] <= 1 and 0 <= r["retrieval"] <= 1
    # the front: exactly the configurations no other has as little KV and as high a top-1 agreement
    points = {k: (r["kv_mib"], r["top1"]) for k, r in rows.items() if r["na"] is None}
    assert set(res["front"]) == {k for k, p in points.items() if not dominated(p, list(points.values()))}
    assert "full" in res["front"] and NA not in res["front"]
    md = (out / "frontier.md").read_text()
    table = [line.split(" | ") for line in md.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == len(LABELS)
    assert {(t[0][2:], t[1]) for t in table if t[-1] == "yes |"} == {
        (rows[k]["policy"] + (" (one-shot)" if rows[k]["protocol"] == "one-shot" else ""),
         str(rows[k]["budget"] or "all")) for k in res["front"]}
    assert "n/a: snapkv++@32: " in md and "python scripts/eval.py --checkpoint" in md
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a plain line per configuration, each with what it measured and the time left
    assert [line.split("]")[0] for line in lines] == [f"[{i}/{len(LABELS)}" for i in range(1, len(LABELS) + 1)]
    assert all("left)" in line and "top-1" in line and "tok/s" in line for line in lines if "n/a" not in line)


def test_quality_is_eval_py_of_the_command_it_names(uninterrupted, tmp_path):
    """scripts/eval.py run with the command frontier.json records gives the same KL, top-1 and needle score for
    every configuration (one code path: eval.py's functions)."""
    _, res, _ = uninterrupted
    assert ev.main(res["eval_argv"] + ["--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    for r in res["rows"]:
        if r["na"] is not None:
            assert str(r["budget"]) not in summary["fidelity"].get("snapkv++ (one-shot)", {})
            continue
        row, budget = ev.label(r["protocol"], r["policy"]), str(r["budget"] or "all")
        fid, needle = summary["fidelity"][row][budget], summary["needle"][row][budget]
        assert (r["kl"], r["top1"], r["ppl"], r["retrieval"]) == (fid["kl"], fid["agree"], fid["ppl"],
                                                                   needle["score"]), r["label"]


def test_speed_is_bench_py_one_in_its_own_process(ckpt, tmp_path, monkeypatch, capsys, no_plots):
    """Not faked: each configuration's speed is bench.py --one's line (the process bench.py runs per configuration)
    with this run's length, budget, steps and dtype; the KV bytes the run computes on the meta device are the ones
    that process allocated."""
    seen = []
    real = fr.run_child
    monkeypatch.setattr(fr, "run_child", lambda cmd: seen.append((cmd, real(cmd))) or seen[-1][1])
    code, err = run(argv(ckpt, tmp_path, "--policies", "full,sink", "--budgets", "32"), capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "frontier.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["full", "sink@32"] and len(seen) == 2
    for r, (cmd, done) in zip(rows, seen):
        assert cmd[:2] == [sys.executable, str(REPO / "scripts" / "bench.py")] and "--compile" not in cmd
        flags = dict(zip(cmd[2::2], cmd[3::2]))
        assert flags["--one"] == flags["--policies"] == r["policy"] and flags["--prompt-tokens"] == str(LENGTH)
        assert flags["--budget"] == "32" and flags["--decode-steps"] == str(STEPS) and flags["--dtype"] == "float32"
        line = json.loads(done.stdout.splitlines()[-1])
        assert all(r[k] == line[k] for k in fr.SPEED) and line["protocol"] == "block"
        assert r["kv_mib"] == line["kv_cache_mib"] and r["decode_tok_s"] > 0


def test_random_weights_measure_speed_only(tiny_config_dir, tmp_path, monkeypatch, capsys):
    """--random-weights: no model loaded here and no quality measured (the table says so); bench.py --one runs the
    shapes with random weights, compiled as generate.py --compile (its default mode: CUDA graphs on a GPU); the front
    is decode tok/s against KV bytes."""
    cmds = []
    started = fake_bench(monkeypatch)
    faked = fr.run_child
    monkeypatch.setattr(fr, "run_child", lambda cmd: cmds.append(cmd) or faked(cmd))
    monkeypatch.setattr(fr, "load_model", lambda *a: pytest.fail("loaded a model"))
    flags = [a for a in ARGS if a != "--eager"]
    code, err = run(["--checkpoint", str(tiny_config_dir), "--out-dir", str(tmp_path), "--random-weights", *flags],
                    capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "frontier.json").read_text())
    assert res["measured"] == {"quality": False, "speed": True} and started == [x for x in LABELS if x != NA]
    assert all("--random-weights" in c and "--compile" in c and "--compile-mode" not in c for c in cmds)
    assert all(r["kl"] is None and r["top1"] is None for r in res["rows"])
    points = {r["label"]: (r["kv_mib"], r["decode_tok_s"]) for r in res["rows"] if r["na"] is None}
    assert set(res["front"]) == {k for k, p in points.items() if not dominated(p, list(points.values()))}
    md = (tmp_path / "frontier.md").read_text()
    assert "quality: not measured (--random-weights" in md and "| not measured | not measured |" in md
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------------- --resume

SOME = ["--policies", "full,sink,keydiff"]  # 5 of the configurations
FIVE = LABELS[:5]


def test_resume_after_ctrl_c_and_a_row_edited_to_garbage(ckpt, uninterrupted, tmp_path, monkeypatch, capsys,
                                                         no_plots):
    _, res, _ = uninterrupted
    full = [r for r in res["rows"] if r["label"] in FIVE]
    started = fake_bench(monkeypatch)
    save = fr.save
    calls = []

    def stop_after_third(*a, **kw):  # Ctrl-C right after the third configuration is on disk
        save(*a, **kw)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
    monkeypatch.setattr(fr, "save", stop_after_third)
    code, err = run(argv(ckpt, tmp_path, *SOME), capsys)
    assert code == 130 and "keeps 3 of 5 configurations" in err and "--resume goes on" in err
    assert [r["label"] for r in json.loads((tmp_path / "frontier.json").read_text())["rows"]] == LABELS[:3]

    monkeypatch.setattr(fr, "save", save)
    started.clear()
    code, err = run(argv(ckpt, tmp_path, *SOME, "--resume"), capsys)
    assert code == 0 and started == ["keydiff@32", "keydiff@64"], err
    assert json.loads((tmp_path / "frontier.json").read_text())["rows"] == full

    # a row edited to garbage and one whose timing is not a number: both measured again, the rest kept
    path = tmp_path / "frontier.json"
    res = json.loads(path.read_text())
    res["rows"][2]["top1"] = "garbage"
    res["rows"][3]["decode_tok_s"] = float("nan")
    path.write_text(json.dumps(res))
    started.clear()
    code, err = run(argv(ckpt, tmp_path, *SOME, "--resume"), capsys)
    assert code == 0 and started == ["sink@64", "keydiff@32"], err
    for label in ("sink@64", "keydiff@32"):  # neither is what the run wrote: its checksum says so first
        assert f"label {label}: its content does not match its checksum (edited since it was written)" in err
    assert json.loads(path.read_text())["rows"] == full

    # a row edited by hand to other numbers, still well-formed: measured again, not served
    res = json.loads(path.read_text())
    res["rows"][2]["top1"] = 1.0 - res["rows"][2]["top1"]
    path.write_text(json.dumps(res))
    started.clear()
    code, err = run(argv(ckpt, tmp_path, *SOME, "--resume"), capsys)
    assert code == 0 and started == ["sink@64"], err
    assert "label sink@64: its content does not match its checksum (edited since it was written): measuring it " \
        "again" in err
    assert json.loads(path.read_text())["rows"] == full

    # other settings: refused in one line, nothing run, the file untouched
    before, started[:] = path.read_bytes(), []
    code, err = run(argv(ckpt, tmp_path, *SOME, "--resume", "--fid-tokens", "6"), capsys)
    assert code == 2 and started == [] and path.read_bytes() == before
    assert err.strip().count("\n") == 0 and "other settings (fid_tokens: 8 there, 6 now)" in err


def test_resume_after_sigkill(ckpt, uninterrupted, tmp_path, no_plots):
    """A run killed once frontier.json holds a row (quality only: no bench.py process) goes on with --resume and
    gives the uninterrupted run's quality and KV bytes."""
    _, res, _ = uninterrupted
    full = [r for r in res["rows"] if r["label"] in FIVE]
    path = tmp_path / "frontier.json"
    p = subprocess.Popen([sys.executable, str(REPO / "scripts" / "frontier.py"),
                          *argv(ckpt, tmp_path, *SOME, "--no-speed")], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline:
        if path.exists() and json.loads(path.read_text())["rows"]:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert fr.main(argv(ckpt, tmp_path, *SOME, "--no-speed", "--resume")) == 0
    rows = json.loads(path.read_text())["rows"]
    keep = ["label", "na", "kv_mib", *fr.QUALITY]
    assert [{k: r[k] for k in keep} for r in rows] == [{k: r[k] for k in keep} for r in full]
    assert all(r["decode_tok_s"] is None for r in rows)
    assert "| not measured | not measured | not measured |" in (tmp_path / "frontier.md").read_text()


def test_resume_refuses_rows_measured_with_another_tokenizer(ckpt, tmp_path, capsys, no_plots):
    """The quality prompts are the tokenizer's ids: after the checkpoint's tokenizer changed (weights and config.json
    as they were), --resume refuses the old rows in one line instead of keeping quality measured on other text."""
    import shutil
    from conftest import with_tiny_tokenizer
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt, folder)
    out = tmp_path / "out"
    quick = ["--policies", "full,sink", "--budgets", "32", "--no-speed"]
    assert run(argv(folder, out, *quick), capsys)[0] == 0
    with_tiny_tokenizer(ckpt, tmp_path / "other", "a completely different corpus of words 42")
    shutil.copy(tmp_path / "other" / "tokenizer.json", folder / "tokenizer.json")
    before = (out / "frontier.json").read_bytes()
    code, err = run(argv(folder, out, *quick, "--resume"), capsys)
    assert code == 2 and "other settings (checkpoint:" in err and err.strip().count("\n") == 0, err
    assert (out / "frontier.json").read_bytes() == before


# ---------------------------------------------------------------------------------------- flags and lines

def test_help_gives_every_flag_and_its_default(capsys):
    ap = fr.parser()
    for action in ap._actions:
        if action.option_strings and action.dest not in ("help", "verbose"):
            assert action.help, action.dest
            assert action.default in (None, False) or "(" in action.help, action.dest


def test_progress_line_gives_the_time_left():
    row = dict(protocol="block", policy="snapkv", budget=256, na=None, kv_mib=12.0, kl=0.3061, top1=0.805,
               retrieval=2 / 3, decode_tok_s=31.2, ttft_s=4.123, prefill_peak_mib=800.0, decode_peak_mib=812.4)
    line = fr.progress(3, 29, row, 48.0, 52.0, 26 * 50.0, "needle")
    assert line == ("[3/29] snapkv @ 256: KV 12.00 MiB (25% of full), KL 0.306, top-1 80.5%, needle 67%, decode "
                    "31.2 tok/s, TTFT 4.12 s, peak 812 MiB (52 s, about 22 min left)")
    assert fr.progress(1, 29, dict(row, na="too small"), 48.0, 0.1, None, "needle") == \
        "[1/29] snapkv @ 256: n/a (too small)"

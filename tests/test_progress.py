"""Progress lines: on a terminal one line redrawn past a delay, at most 4 a second, cleared at the end; off a
terminal a plain line every few seconds; --quiet silences both. The engine's prefill callback; generate.py's and
eval.py's progress on a terminal and in a pipe."""
import io
import re
import time

import pytest

import progress
from progress import CLEAR, Progress, Ticker


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def lines(text):
    """The lines drawn (each one follows a CLEAR), without the final clear."""
    assert text.startswith(CLEAR), repr(text)
    return text.split(CLEAR)[1:]


def test_progress_on_a_terminal_rewrites_one_line_and_clears_it():
    out, clock = FakeTTY(), Clock()
    with Progress(4000, "prefill", "tokens", rate_unit="tok", stream=out, clock=clock) as bar:
        for done in (1024, 2048, 4000):
            clock.t += 2.0
            bar.update(done)
    drawn = lines(out.getvalue())
    assert drawn == ["prefill 1,024/4,000 tokens  512 tok/s  2.0 s", "prefill 2,048/4,000 tokens  512 tok/s  4.0 s",
                     "prefill 4,000/4,000 tokens  667 tok/s  6.0 s", ""]  # "": the line cleared at the end
    assert "\n" not in out.getvalue()


def test_progress_rate_scale_and_unit():
    out, clock = FakeTTY(), Clock()
    bar = Progress(30, "prefill (one-shot) 3,000 tokens:", "layers", rate_unit="tok", scale=100, stream=out,
                   clock=clock)
    clock.t += 2.0
    bar.update(12)
    assert lines(out.getvalue()) == ["prefill (one-shot) 3,000 tokens: 12/30 layers  600 tok/s  2.0 s"]
    bar.close()
    assert out.getvalue().endswith(CLEAR)


@pytest.mark.parametrize("case", ["disabled", "quiet on a terminal", "quiet off a terminal"])
def test_progress_silent_when_disabled_or_quiet(case, monkeypatch):
    out, clock = (io.StringIO() if case.endswith("off a terminal") else FakeTTY()), Clock()
    if case.startswith("quiet"):
        monkeypatch.setattr(progress, "quiet", True)
    with Progress(10, "work", "steps", stream=out, clock=clock, enabled=case != "disabled") as bar:
        for done in range(1, 11):
            clock.t += 1.0
            bar.update(done)
    assert out.getvalue() == ""


def test_progress_off_a_terminal_writes_a_plain_line_every_few_seconds():
    """A pipe or a log (eval.py | tee printed nothing for 331 s): a whole line every LOG_INTERVAL seconds, the first
    after LOG_INTERVAL, never a carriage return, nothing to clear at the end."""
    out, clock = io.StringIO(), Clock()
    with Progress(24, "fidelity", "prompts", stream=out, clock=clock) as bar:
        bar.note = "keydiff @ 128"
        for done in range(1, 25):
            clock.t += 1.0
            bar.update(done)
    assert progress.LOG_INTERVAL == 5.0
    assert out.getvalue().splitlines() == [f"fidelity {n}/24 prompts  1 prompts/s  {n}.0 s  keydiff @ 128"
                                           for n in (5, 10, 15, 20)]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue() and out.getvalue().endswith("\n")


def test_progress_nothing_before_the_delay():
    out, clock = FakeTTY(), Clock()
    with Progress(10, "work", "steps", stream=out, clock=clock, delay=1.5) as bar:
        for done in range(1, 11):
            clock.t += 0.1  # all done in 1 s: nothing, not even the final update or a clear
            bar.update(done)
    assert out.getvalue() == ""
    out, clock = FakeTTY(), Clock()
    with Progress(10, "work", "steps", stream=out, clock=clock, delay=1.5) as bar:
        for done in range(1, 11):
            clock.t += 0.2
            bar.update(done)
    assert [re.match(r"work (\d+)/10", s)[1] for s in lines(out.getvalue())[:-1]] == ["8", "10"]  # from 1.6 s on


def test_progress_rate_limited_but_the_final_update_drawn():
    out, clock = FakeTTY(), Clock()
    with Progress(100, "work", "steps", stream=out, clock=clock, delay=0) as bar:
        for done in range(1, 101):
            clock.t += 0.01  # 100 updates in 1 s: at most 4 a second, plus the last
            bar.update(done)
    drawn = [int(re.match(r"work (\d+)/100", s)[1]) for s in lines(out.getvalue())[:-1]]
    assert drawn[-1] == 100 and 4 <= len(drawn) <= 6, drawn
    assert all(b - a >= 25 for a, b in zip(drawn[:-2], drawn[1:-1])), drawn


def test_progress_line_fits_the_terminal(monkeypatch):
    out = FakeTTY()
    monkeypatch.setattr(progress, "columns", lambda stream: 20)
    bar = Progress(10, "converting a-very-long-file-name.gguf", "tensors", stream=out, delay=0)
    bar.update(5)
    assert lines(out.getvalue()) == ["converting a-very-l"]  # 19 columns: the cursor stays on the line


def test_ticker_counts_seconds_on_a_terminal_and_clears():
    out, clock = FakeTTY(), Clock()
    with Ticker("compiling the decode step (max-autotune)", stream=out, interval=0.01, clock=clock):
        clock.t += 12.3
        time.sleep(0.2)
    drawn = lines(out.getvalue())
    assert drawn[0] == "compiling the decode step (max-autotune) ... 12 s" and drawn[-1] == "", drawn
    assert set(drawn[:-1]) == {drawn[0]}


@pytest.mark.parametrize("case", ["disabled", "quiet"])
def test_ticker_silent_when_disabled_or_quiet(case, monkeypatch):
    out = FakeTTY()
    if case == "quiet":
        monkeypatch.setattr(progress, "quiet", True)
    with Ticker("compiling", stream=out, interval=0.01, enabled=case != "disabled") as t:
        time.sleep(0.1)
    assert out.getvalue() == "" and t.thread is None


def test_ticker_off_a_terminal_writes_plain_lines():
    out, clock = io.StringIO(), Clock()
    with Ticker("compiling the decode step (aot)", stream=out, interval=0.01, clock=clock):
        clock.t += 5.0
        time.sleep(0.2)
    drawn = out.getvalue().splitlines()
    assert drawn and set(drawn) == {"compiling the decode step (aot) ... 5 s"} and "\r" not in out.getvalue()


# ------------------------------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def tiny_model(hf_tiny):
    import torch
    from loading import load_model
    _, ckpt = hf_tiny("llama")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only cost here
    yield load_model(ckpt, torch.float32, "cpu")
    torch.set_num_threads(n)


@pytest.mark.parametrize("protocol", ["block", "one-shot"])
def test_generate_reports_prefill_progress(tiny_model, protocol):
    """on_prefill(done, 45): after each block of 16 tokens (16, 32, 45), or one-shot after each of the 2 layers (22,
    45); the tokens generated are those of a run without the callback."""
    import policies
    from engine import generate, setup
    from runtime import model_step, prefill_step
    prompt = list(range(1, 46))
    one_shot = protocol == "one-shot"
    runs = []
    for callback in (None, True):
        setup(tiny_model, policies.make("snapkv:window=8"), 24, len(prompt), 4, 16, prefill=protocol)
        calls = []
        out, _ = generate(tiny_model, prompt, 4, block_size=16, steps=(prefill_step, model_step), one_shot=one_shot,
                          on_prefill=(lambda done, total: calls.append((done, total))) if callback else None)
        runs.append(out)
    assert calls == ([(22, 45), (45, 45)] if one_shot else [(16, 45), (32, 45), (45, 45)])
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------------- generate.py

@pytest.fixture(autouse=True)
def not_quiet(monkeypatch):
    """generate.run sets progress.quiet from --quiet for the process: each test starts, and leaves it, as it was."""
    monkeypatch.setattr(progress, "quiet", False)


@pytest.fixture(scope="module")
def tiny_ckpt(hf_tiny, tmp_path_factory):
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    return with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_progress"), "the quick brown fox jumps over the dog")


PROMPT = "the quick brown fox jumps over the lazy dog, " * 3


def run_on_a_terminal(ckpt, extra, monkeypatch):
    """generate.main with stdout and stderr fake terminals and no delay before a progress line; returns the writes in
    order, as (stream, text)."""
    import generate
    log = []

    class Recorder(FakeTTY):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def write(self, text):
            log.append((self.name, text))
            return len(text)

    monkeypatch.setattr(progress, "DELAY", 0)
    monkeypatch.setattr("sys.stdout", Recorder("out"))
    monkeypatch.setattr("sys.stderr", Recorder("err"))
    code = generate.main(["--checkpoint", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "3", "--block-size", "4",
                          "--threads", "1", *extra])
    assert code == 0, log
    return log


@pytest.mark.parametrize("extra", [[], ["--prefill", "one-shot", "--policy", "snapkv:window=4", "--budget", "8"],
                                   ["--json"]])
def test_generate_shows_prefill_progress_on_a_terminal_and_erases_it_first(tiny_ckpt, extra, monkeypatch):
    log = run_on_a_terminal(tiny_ckpt, extra, monkeypatch)
    first_out = next(i for i, (name, _) in enumerate(log) if name == "out")
    before, after = log[:first_out], log[first_out:]
    assert {name for name, _ in before} == {"err"} and before[-1] == ("err", CLEAR), before  # erased before the text
    drawn = [text for _, text in before[:-1]]
    assert drawn and all(text.startswith(CLEAR) for text in drawn), drawn
    if "one-shot" in extra:
        assert re.fullmatch(r"\r\x1b\[Kprefill \(one-shot\) \d+ tokens: 2/2 layers  [\d,]+ tok/s  \d+\.\d s", drawn[-1])
    else:
        assert re.fullmatch(r"\r\x1b\[Kprefill (\d+)/\1 tokens  [\d,]+ tok/s  \d+\.\d s", drawn[-1]), drawn
    assert not any("\r" in text for name, text in after if name == "err")  # the summary: plain lines
    if "--json" in extra:
        import json
        assert json.loads("".join(text for name, text in after if name == "out"))["generated_tokens"] == 3


def test_generate_quiet_prints_no_progress_on_a_terminal(tiny_ckpt, monkeypatch):
    log = run_on_a_terminal(tiny_ckpt, ["--quiet"], monkeypatch)
    err = "".join(text for name, text in log if name == "err")
    assert "\r" not in err and "prefill" not in err.split("---")[0] and "--- " in err  # the summary, no line
    assert any(name == "out" and text for name, text in log)


@pytest.mark.parametrize("terminal", [False, True])
def test_generate_prints_plain_progress_lines_to_a_pipe(tiny_ckpt, terminal):
    """A real process, no delay before a line: stderr a pipe gets plain lines (no carriage return, no escape), none
    with --quiet; the same run with stderr a pseudo-terminal gets its redrawn line."""
    import os
    import subprocess
    import sys
    from conftest import REPO
    code = ("import sys, progress; progress.DELAY = progress.LOG_INTERVAL = 0; import generate; "
            f"sys.exit(generate.main(sys.argv[1:]))")
    argv = [sys.executable, "-c", code, "--checkpoint", str(tiny_ckpt), "--prompt", PROMPT, "--max-new-tokens", "3",
            "--block-size", "4", "--threads", "1"]
    if not terminal:
        for quiet in (False, True):
            r = subprocess.run(argv + ["--quiet"] * quiet, cwd=REPO, capture_output=True, timeout=300)  # bytes
            assert r.returncode == 0, r.stderr
            assert b"\r" not in r.stderr and b"\x1b" not in r.stderr and b"--- " in r.stderr, r.stderr
            lines = [line for line in r.stderr.split(b"\n") if line.startswith(b"prefill ")]
            assert (lines == []) == quiet, r.stderr
            assert quiet or re.fullmatch(rb"prefill (\d+)/\1 tokens  [\d,]+ tok/s  \d+\.\d s", lines[-1]), lines
        return
    master, slave = os.openpty()
    try:
        p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        err = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            err += chunk
        assert p.wait(timeout=300) == 0, err
    finally:
        os.close(master)
    assert b"\r\x1b[Kprefill " in err and b"--- " in err, err


# ------------------------------------------------------------------------------------- conversion, quantization

def on_a_terminal(monkeypatch):
    """stderr a fake terminal on which every update is drawn, from the first on; returns it. Called in the test: pytest
    sets sys.stderr again after the fixtures."""
    err = FakeTTY()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress, "DELAY", 0)
    monkeypatch.setattr(progress, "INTERVAL", 0)
    monkeypatch.setattr(progress, "columns", lambda stream: 1000)  # the paths of tmp_path in full
    return err


def counts(err, pattern):
    """The `done` of each line matching `pattern` (a regex with the done count as group 1 and the total as group 2,
    matched at the start), checked to end at the total; and that the last thing written clears the line."""
    drawn = [m for s in lines(err.getvalue()) if (m := re.match(pattern, s))]
    assert drawn and err.getvalue().endswith(CLEAR), err.getvalue()
    assert drawn[-1][1] == drawn[-1][2], drawn[-1][0]
    return [int(m[1]) for m in drawn]


def test_hashing_counts_mib(tmp_path, monkeypatch):
    import hashlib
    from convert import hash_file
    terminal = on_a_terminal(monkeypatch)
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * (3 << 20) + b"y")
    assert hash_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert counts(terminal, r"hashing w\.bin (\d+)/(\d+) MiB  [\d,]+ MiB/s") == [1, 2, 3, 4]


def test_gguf_conversion_counts_tensors(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from test_gguf_convert import write_tiny_llama
    from convert import convert_gguf
    terminal = on_a_terminal(monkeypatch)
    convert_gguf(write_tiny_llama(tmp_path / "tiny.gguf"), tmp_path / "out")
    assert counts(terminal, r"converting tiny\.gguf (\d+)/(\d+) tensors") == list(range(1, 13))


def test_hf_conversion_counts_layers(hf_tiny, tmp_path, monkeypatch):
    import shutil
    from convert import convert_hf_dir
    _, src = hf_tiny("llama")
    terminal = on_a_terminal(monkeypatch)
    d = shutil.copytree(src, tmp_path / "hf")
    convert_hf_dir(d)
    assert counts(terminal, r"converting hf (\d+)/(\d+) layers") == [1, 2]


def test_quantization_counts_tensors_the_tied_head_included(hf_tiny, tmp_path, monkeypatch):
    import quantize
    _, src = hf_tiny("qwen2")  # tied: the int8 head is a quantized copy of the embedding, one step more
    terminal = on_a_terminal(monkeypatch)
    quantize.quantize_dir(src, "int8", out=tmp_path / "q")
    n = counts(terminal, r"quantizing \S+ to int8 (\d+)/(\d+) tensors")
    assert n == list(range(1, len(quantize.open_tensors(src)[1]) + 2))


def test_reading_a_gguf_and_writing_an_engine_file_tick(tmp_path, monkeypatch):
    """Work without steps shows the seconds (made slow here: each one sleeps past a tick)."""
    gguf = pytest.importorskip("gguf")
    import convert
    from test_gguf_convert import write_tiny_llama
    terminal = on_a_terminal(monkeypatch)
    monkeypatch.setattr(progress, "TICK", 0.01)
    reader, write = gguf.GGUFReader, convert.write_atomic
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a: (time.sleep(0.1), reader(*a))[1])
    monkeypatch.setattr(convert, "write_atomic", lambda *a: (time.sleep(0.1), write(*a))[1])
    convert.convert_gguf(write_tiny_llama(tmp_path / "tiny.gguf"), tmp_path / "out")
    drawn = lines(terminal.getvalue())
    assert "reading tiny.gguf ... 0 s" in drawn and f"writing {tmp_path / 'out' / convert.ENGINE_FILE} ... 0 s" in drawn
    assert terminal.getvalue().endswith(CLEAR)


@pytest.mark.parametrize("script", ["quantize", "convert"])
def test_scripts_quiet(hf_tiny, tmp_path, script, monkeypatch):
    """--quiet: nothing on the terminal but the result; without it, the progress lines (the control)."""
    import shutil
    _, src = hf_tiny("llama")
    terminal = on_a_terminal(monkeypatch)
    for quiet in (False, True):
        terminal.seek(0)
        terminal.truncate()
        if script == "quantize":
            from scripts.quantize import main
            code = main(["--checkpoint", str(src), "--mode", "int8", "--out", str(tmp_path / f"q{quiet}")]
                        + ["--quiet"] * quiet)
        else:
            from scripts.convert_hf_checkpoint import main
            code = main(["--checkpoint", str(shutil.copytree(src, tmp_path / f"hf{quiet}"))] + ["--quiet"] * quiet)
        assert code == 0, terminal.getvalue()
        assert (CLEAR in terminal.getvalue()) != quiet, terminal.getvalue()

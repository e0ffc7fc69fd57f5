"""generate.py as a user runs it: bad input gets one line on stderr and exit code 2, good input a summary."""
import argparse
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, env_with_tmpdir

import generate


@pytest.fixture(scope="module")
def tiny_ckpt(hf_tiny, tmp_path_factory):
    """The tiny llama checkpoint with a small tokenizer and a context of 256 (for the length errors)."""
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    d = with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_cli"), "the quick brown fox jumps over the lazy dog")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def run_main(argv, capsys):
    code = generate.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_tiny_run_prints_summary(tiny_ckpt, capsys):
    code, out, err = run_main(["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox jumps over the lazy dog, " * 3,
                               "--max-new-tokens", "5", "--json", "--policy", "random", "--budget", "8",
                               "--block-size", "4"], capsys)
    assert code == 0, err
    stats = json.loads(out)
    assert stats["generated_tokens"] == 5 and stats["prompt_tokens"] > 4
    # 2 layers x (K and V) x 2 KV heads x (budget + block) slots x head_dim 16 x 4 bytes
    assert stats["kv_cache_bytes"] == 2 * 2 * 2 * (8 + 4) * 16 * 4
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "prefill_peak_bytes", "decode_peak_bytes",
                "bandwidth_gb_s", "memory_measure"):
        assert key in stats
    # the process peak covers loading (and compiling) too: never below a phase's own peak
    assert stats["process_peak_bytes"] >= max(stats["prefill_peak_bytes"], stats["decode_peak_bytes"],
                                              stats["startup_peak_bytes"]) > 0
    assert stats["compile_cache"] is None


def test_stderr_goes_to_the_compile_log_and_progress_to_the_terminal(tmp_path, capfd, monkeypatch):
    import tempfile

    from cli import stderr_to_log
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with stderr_to_log("compile.log", verbose=False) as terminal:
        os.write(2, b"AUTOTUNE table from C\n")
        print("a Python warning", file=sys.stderr)
        terminal.write("compiling ... 3 s")
        terminal.flush()
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert err == "compiling ... 3 safter\n"
    log = tmp_path / f"budgetkv-{os.getuid()}" / "compile.log"
    assert log.read_text() == "AUTOTUNE table from C\na Python warning\n"
    with stderr_to_log("compile.log", verbose=True) as terminal:  # -v: everything stays on the terminal
        os.write(2, b"noise\n")
        assert terminal is sys.stderr
    assert capfd.readouterr().err == "noise\n"


LOGS_SCRIPT = """
import argparse, os, sys
sys.path.insert(0, {repo!r})
import cli, ranks
with cli.compile_log("default", False):  # what a compile writes to stderr
    os.write(2, b"compiler noise\\n")
print(cli.run_cli(lambda a: 1 / 0, argparse.Namespace()))  # an internal error
ranks.quiet_other_ranks()  # rank 1 of 2 under torchrun
print("rank noise", file=sys.stderr)
"""


def plant(tmp_path, how: str):
    """A victim file, links to it at the three logs' old fixed names, and in the private folder's place `how`:
    links to the victim at each log's name, a folder at each name, the folder itself a link to a folder of such
    links, or the folder another user's. Returns the victim."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in ("error", "compile", "rank1"):
        (tmp_path / f"budgetkv-{name}.log").symlink_to(victim)
    folder = tmp_path / f"budgetkv-{os.getuid()}"
    target = tmp_path / "elsewhere" if how == "folder link" else folder
    target.mkdir(mode=0o700)
    for name in ("error", "compile", "rank1"):
        if how == "folders":
            (target / f"{name}.log").mkdir()
        else:
            (target / f"{name}.log").symlink_to(victim)
    if how == "folder link":
        folder.symlink_to(target, target_is_directory=True)
    if how == "another user's folder":
        os.chown(folder, 4242, 4242)
    return victim


@pytest.mark.parametrize("how", ["links", "folders", "folder link", "another user's folder"])
def test_logs_are_private_and_never_follow_a_planted_link(tmp_path, how):
    """The error log, the compile log and a rank's log, with links to a victim file planted at their old fixed
    names and, in the user's private folder's place, links, folders, the folder a link, or another user's folder:
    the victim is untouched, each log lands in a regular file of mode 0600 under the temporary folder, and the
    lines that name a log name the one written (a note for the compile and rank logs, the internal error's line);
    no traceback."""
    if how == "another user's folder" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    victim = plant(tmp_path, how)
    env = {**os.environ, "TMPDIR": str(tmp_path), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    env.pop("BUDGETKV_VERBOSE", None)
    r = subprocess.run([sys.executable, "-c", LOGS_SCRIPT.format(repo=str(REPO))], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout == "1\n" and "Traceback" not in r.stderr, r.stderr
    assert victim.read_text() == "precious"
    lines = r.stderr.splitlines()
    named = [re.search(r"(?:this log is|its stderr goes to|traceback in) (\S+)", line).group(1) for line in lines]
    assert len(lines) == 3 and all(f"cannot use {tmp_path}/budgetkv-{os.getuid()}/" in line for line in lines), lines
    for path, text in zip(named, ("compiler noise", "Traceback (most recent call last)", "rank noise")):
        st = os.lstat(path)
        assert path.startswith(f"{tmp_path}/budgetkv-") and stat.S_ISREG(st.st_mode), path
        assert stat.S_IMODE(st.st_mode) == 0o600 and text in open(path).read()


def test_an_output_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    """files.write_atomic and the profiler's trace write a predictable temporary name beside the output
    (.budgetkv-tmp-<pid>-<name>): a link planted there to a victim file leaves the victim's content and mode as they
    were, and the output is a regular file with the new content."""
    import files

    class Prof:
        def export_chrome_trace(self, name):  # as torch's exporter: <name>.tmp written, then renamed over <name>
            with open(name + ".tmp", "w") as f:
                f.write("trace")
            os.replace(name + ".tmp", name)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    for out, write in ((tmp_path / "out.json", lambda p: files.write_text(p, "new")),
                       (tmp_path / "trace.json", lambda p: files.export_trace(Prof(), p))):
        tmp = files.tmp_path(out)
        for name in (tmp, tmp.with_name(tmp.name + ".tmp")):
            name.symlink_to(victim)
        write(out)
        assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
        assert not out.is_symlink() and out.read_text() in ("new", "trace")


def test_checking_an_output_never_creates_what_a_link_there_points_to(tmp_path):
    """files.check_writable (each script's --json, --plot, --out-dir file) on a dangling link: nothing is created
    at the link's target and the link stays until the output replaces it."""
    import files
    link, target = tmp_path / "out.json", tmp_path / "elsewhere" / "victim.json"
    target.parent.mkdir()
    link.symlink_to(target)
    files.check_writable(link, "--json")
    assert not target.exists() and link.is_symlink()


def test_logs_go_to_a_private_folder(tmp_path, monkeypatch, capfd):
    """Nothing planted: every log in $TMPDIR/budgetkv-<uid> (0700), each 0600; no note."""
    import tempfile

    import files
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fd, path, note = files.open_log("error.log")
    os.close(fd)
    assert (path, note) == (tmp_path / f"budgetkv-{os.getuid()}" / "error.log", None)
    assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700 and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    path.chmod(0o644)  # a log left readable by an older run: made private again
    os.close(files.open_log("error.log")[0])
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


def test_the_error_log_redacts_secrets(tmp_path, monkeypatch, capfd):
    """The command line heading the error log, and the traceback under it, hold no token, secret or password: not
    --hf-token X, --hf-token=X, HF_TOKEN=X on the command line, nor the environment's HF_TOKEN; other flags stay."""
    import tempfile

    import cli
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_fromtheenvironment")
    monkeypatch.setattr(sys, "argv", ["scripts/download.py", "--hf-token", "hf_given_apart", "--max-new-tokens", "5",
                                      "--api-token=hf_given_with_equals", "MY_SECRET=s3cr3t-value", "--password",
                                      "pw"])
    assert cli.internal_error(ValueError("refused for hf_given_apart and hf_fromtheenvironment"), False) == 1
    log = (tmp_path / f"budgetkv-{os.getuid()}" / "error.log").read_text()
    assert log.splitlines()[0] == ("scripts/download.py --hf-token *** --max-new-tokens 5 --api-token=*** "
                                   "MY_SECRET=*** --password ***")
    assert "ValueError: refused for *** and ***" in log
    for secret in ("hf_given_apart", "hf_fromtheenvironment", "hf_given_with_equals", "s3cr3t-value"):
        assert secret not in log
    assert f"traceback in {tmp_path}/budgetkv-{os.getuid()}/error.log;" in capfd.readouterr().err


def test_threads_flag_sets_torch_threads(tiny_ckpt, capsys):
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1 already (as in a `pytest -n 2` worker): the flag must be what sets it
    try:
        code, out, err = run_main(["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox", "--json",
                                   "--max-new-tokens", "2", "--threads", "1"], capsys)
        assert code == 0, err
        assert json.loads(out)["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_profile_writes_a_whole_trace_or_fails_in_one_line(tiny_ckpt, tmp_path, capsys, monkeypatch):
    argv = ["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox", "--max-new-tokens", "2", "--json"]
    code, _, err = run_main(argv + ["--profile", str(tmp_path / "t.json")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] and os.listdir(tmp_path) == ["t.json"]
    import torch.profiler
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)  # a failed write
    code, _, err = run_main(argv + ["--profile", str(tmp_path / "u.json")], capsys)
    assert code == 1 and err.strip().splitlines() == [f"error: cannot write {tmp_path / 'u.json'}: the profiler could "
                                                      "not write its trace (a full disk or a file size limit?)"], err
    assert os.listdir(tmp_path) == ["t.json"]


@pytest.mark.parametrize("kv_dtype,slot_bytes", [("int8", 16 + 4), ("bfloat16", 16 * 2)])
def test_narrow_kv_run_reports_the_smaller_buffer(tiny_ckpt, capsys, kv_dtype, slot_bytes):
    argv = ["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox jumps over the lazy dog, " * 3,
            "--max-new-tokens", "5", "--policy", "keydiff", "--budget", "8", "--block-size", "4",
            "--kv-dtype", kv_dtype]
    code, out, err = run_main(argv + ["--json"], capsys)
    assert code == 0, err
    stats = json.loads(out)
    # 2 layers x (K and V) x 2 KV heads x (budget + block) slots x (head_dim 16 int8 + one fp32 scale, or 16 bf16)
    assert stats["kv_cache_bytes"] == 2 * 2 * 2 * (8 + 4) * slot_bytes and stats["kv_dtype"] == kv_dtype
    code, _, err = run_main(argv, capsys)
    assert code == 0 and f"MiB ({kv_dtype})" in err, err
    if kv_dtype == "bfloat16":  # a run that does not compute in float32 has nothing to halve
        for dtype in ("bfloat16", "float16"):
            code, out, err = run_main(argv + ["--dtype", dtype], capsys)
            assert code == 2 and not out and err.strip().splitlines() == [
                f"error: --kv-dtype bfloat16 halves a float32 run's cache; this run computes in {dtype}, whose own "
                "cache is as small: drop --kv-dtype or give --dtype float32"], err


BAD = [
    (["--checkpoint", "no-such-model"], "unknown checkpoint"),
    (["--budget", "0"], "--budget must be >= 1"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--budget", "300"], "larger than the model's context"),
    (["--block-size", "300"], "larger than the model's context"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["--prompt", "the quick brown fox " * 100], "longer than the model's context"),
    (["--policy", "nope"], "unknown policy"),
    (["--compile", "--compile-mode", "fastest"], "invalid choice"),
    (["--compile", "--compile-mode", "aot", "--freeze"], "--compile-mode aot compiles the CPU decode step, unfrozen"),
    (["--compile", "--compile-mode", "aot", "--speculate", "2"], "--speculate's steps are torch.compile's"),
    (["--no-compile-prefill"], "need --compile"),
    (["--compile-prefill"], "need --compile"),
    (["--compile-mode", "default"], "--compile-mode / --freeze need --compile"),
    (["--freeze"], "--freeze need --compile"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--batch-size", "3", "--prompt", "the fox", "--prompt", "the dog"], "--batch-size 3 with 2 prompts"),
    (["--budget", "abc"], "invalid int value"),
    (["--policy", "full", "--budget", "4"], "must be >= prompt + --max-new-tokens"),
    (["--top-p", "0"], "top-p"),
    (["--policy", "sink", "--budget", "3"], "must exceed the 4 sink tokens"),
    (["--policy", "snapkv", "--budget", "16"], "observation window"),
    (["--policy", "keydiff:window_frac=-0.1", "--budget", "16"], "window_frac must be in [0, 1)"),
    (["--policy", "h2o:window_frac=1.5", "--budget", "16"], "window_frac must be in [0, 1)"),
    (["--policy", "snapkv:kernel=4", "--budget", "64"], "odd"),
    (["--policy", "keydiff:kernel=3"], "policy keydiff has no parameter 'kernel'"),
    (["--policy", "keydiff:window_frac"], "malformed policy parameter 'window_frac'"),
    (["--policy", "keydiff:"], "nothing after ':'"),
    (["--policy", "keydiff:,"], "malformed policy parameter"),
    (["--policy", "keydiff:=0.1"], "malformed policy parameter"),
    (["--policy", "keydiff:window_frac=abc"], "window_frac takes float, got 'abc'"),
    (["--policy", "keydiff:window_frac=0.1,window_frac=0.2"], "given twice"),
    (["--policy", "keydiff:anchor=median"], "anchor must be one of raw, normalized"),
    (["--policy", "sink:n_sink=2.5"], "n_sink takes int"),
    (["--policy", "tova:keep_last=maybe"], "keep_last takes bool"),
    (["--policy", "full:budget=3"], "policy full has no parameters"),
    (["--policy", "rocketkv:read=0"], "read must be >= 1"),
    (["--policy", "exact-topk:k=-1"], "k must be >= 1"),
    (["--policy", "exact-topk", "--budget", "2"], "must be >= prompt + --max-new-tokens"),
    (["--prefill", "sideways"], "invalid choice"),
    (["--kv-dtype", "int4"], "invalid choice"),
    (["--policy", "sagekv", "--budget", "64", "--evict-before-attend"], "--evict-before-attend applies"),
    (["--policy", "keydiff", "--budget", "8", "--block-size", "16", "--evict-before-attend"],
     "needs --budget >= --block-size (8 < 16)"),
    (["--policy", "caote:sink"], "unknown policy"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--seed", "99999999999999999999999"], "--seed must be in [0, 2**63)"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--prompt", "the fox", "--prompt", "  "], "prompt 2 of the batch is empty"),
    (["--prompt", "the fox", "--prompt", "the dog", "--prompt-file", "/nonexistent/p.jsonl"],
     "--prompt with --prompt-file is one question after one document"),
    (["--prompt", "the fox", "--prompt", "the quick brown fox jumps over the lazy dog " * 3, "--max-new-tokens", "250"],
     "the longest prompt (prompt 2 of the batch, "),
    (["--prompt", "the fox", "--prompt", "the dog", "--policy", "sink", "--budget", "3"], "must exceed the 4 sink"),
    (["--prompt", "the fox", "--prompt", "the quick brown fox jumps over the lazy dog " * 4, "--policy", "sagekv",
      "--budget", "24"], "sagekv plans a"),
    (["--profile", "/proc/no/such/dir/t.json"], "--profile /proc/no/such/dir/t.json: cannot write there"),
    (["--profile", "/proc/t.json"], "--profile /proc/t.json: cannot write there"),
    (["--policy", "caote:tova:heads=all", "--budget", "16"], "heads=all is not supported"),
    (["--policy", "snapkv++", "--compile", "--compile-prefill"], "apply to --prefill block"),
    (["--top-k", "5"], "--top-k applies to sampling"),
    (["--temperature", "1e-9", "--top-p", "0.9", "--seed", "1"], "--top-p applies to sampling"),
    (["--temperature", "1e-9", "--seed", "1"], "--seed applies to sampling"),
    (["--compile-mode", "auto"], "need --compile"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_one_line_exit_2(tiny_ckpt, capsys, extra, message):
    if extra[0] == "--device" and generate.torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    prompt = [] if {"--prompt", "--prompt-file"} & set(extra) else ["--prompt", "the fox"]
    argv = ["--checkpoint", str(tiny_ckpt), "--max-new-tokens", "4"] + prompt + extra
    try:
        code = generate.main(argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "the fox"}', '["the dog"]'], "line 2: a prompt line is a JSON object, not a list"),
    (['{"prompt": "the fox"}', '', '{"text": "the dog"}'], 'line 3: no "prompt" string'),
    (['{"prompt": "the fox"}', '{"prompt": 7}'], 'line 2: no "prompt" string'),
    (['{"prompt": "the fox"', '{"prompt": "the dog"}'], "line 1 is not JSON"),
    (['{"prompt": "the fox"}', '{"prompt": " "}'], "prompt 2 of the batch is empty"),
    (['', ' '], "holds no prompt"),
])
def test_bad_jsonl_prompt_file_one_line_exit_2(tiny_ckpt, tmp_path, capsys, lines, message):
    """A .jsonl --prompt-file is a batch; a bad line is named by its number, before anything is generated."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(lines) + "\n")
    code, out, err = run_main(["--checkpoint", str(tiny_ckpt), "--prompt-file", str(f), "--max-new-tokens", "2"],
                              capsys)
    assert code == 2 and out == ""
    err_lines = err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error:") and message in err_lines[0], err


def test_batch_prints_every_sequence_as_its_batch_one_run(tiny_ckpt, tmp_path, capsys):
    """Prompts of different lengths from a .jsonl file (or repeated --prompt) run as one batch: --json gives each
    sequence's text and ids, equal to a run of that prompt alone; without --json each sequence is printed under a
    [i/n] header; --batch-size N repeats one prompt."""
    prompts = ["the quick brown fox jumps over the lazy dog, " * 3, "the lazy dog", "the fox jumps over the dog"]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["--checkpoint", str(tiny_ckpt), "--max-new-tokens", "5", "--policy", "keydiff", "--budget", "8",
              "--block-size", "4"]
    code, out, err = run_main(common + ["--prompt-file", str(f), "--json"], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["batch_size"] == 3 and len(got["sequences"]) == 3
    assert got["decode_tokens"] == 3 * 4 and got["decode_tok_s"] > 0
    for p, seq in zip(prompts, got["sequences"]):
        code, out, err = run_main(common + ["--prompt", p, "--json"], capsys)
        assert code == 0, err
        alone = json.loads(out)
        assert (seq["token_ids"], seq["text"], seq["prompt_tokens"]) == (alone["token_ids"], alone["text"],
                                                                         alone["prompt_tokens"])
    code, out, err = run_main(common + [arg for p in prompts for arg in ("--prompt", p)], capsys)
    assert code == 0, err
    assert sorted(line[:5] for line in out.splitlines() if line.startswith("[")) == ["[1/3]", "[2/3]", "[3/3]"]
    assert "batch of 3:" in err
    code, out, err = run_main(common + ["--prompt", prompts[1], "--batch-size", "2", "--json"], capsys)
    assert code == 0, err
    seqs = json.loads(out)["sequences"]
    assert len(seqs) == 2 and seqs[0]["token_ids"] == seqs[1]["token_ids"]


def test_defaults_are_clamped_to_the_context_and_said_so(tiny_ckpt, tmp_path, capsys):
    """A default larger than the model's context (256 here) is clamped, and the summary says so; the same value
    given explicitly is refused."""
    prompt = ["--prompt", "the quick brown fox " * 30]
    code, out, err = run_main(["--checkpoint", str(tiny_ckpt), *prompt, "--policy", "keydiff", "--json"], capsys)
    assert code == 0, err
    stats = json.loads(out)
    L = stats["prompt_tokens"]
    assert stats["budget"] == 256 and stats["max_new_tokens"] == 256 - L < 200
    assert stats["clamped_to_context"] == {"max_new_tokens": {"default": 200, "used": 256 - L},
                                           "budget": {"default": 2048, "used": 256}}
    code, _, err = run_main(["--checkpoint", str(tiny_ckpt), *prompt, "--max-new-tokens", "200"], capsys)
    assert code == 2 and "exceeds the model's context (256)" in err
    # the text summary: one line naming every clamped default; none when nothing was clamped
    d = tmp_path / "ctx64"
    shutil.copytree(tiny_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=64)))
    code, _, err = run_main(["--checkpoint", str(d), "--prompt", "the fox", "--policy", "tova"], capsys)
    assert code == 0, err
    assert err.strip().splitlines()[-1] == ("defaults clamped to the model's context (64): --max-new-tokens 200 -> "
                                            f"{64 - 2}, --block-size 128 -> 64, --budget 2048 -> 64")
    code, _, err = run_main(["--checkpoint", str(d), "--prompt", "the fox", "--max-new-tokens", "2",
                             "--block-size", "16"], capsys)
    assert code == 0 and "clamped" not in err


def test_bad_checkpoints(tiny_ckpt, tmp_path, capsys):
    # a config.json for an unsupported architecture
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run_main(["--checkpoint", str(d), "--prompt", "hi"], capsys)
    assert code == 2 and "unsupported architecture 'GPT2LMHeadModel'" in err

    # missing safetensors
    d = tmp_path / "nosafe"
    shutil.copytree(tiny_ckpt, d)
    (d / "model.safetensors").unlink()
    code, _, err = run_main(["--checkpoint", str(d), "--prompt", "hi"], capsys)
    assert code == 2 and "no *.safetensors" in err

    # truncated safetensors
    d = tmp_path / "trunc"
    shutil.copytree(tiny_ckpt, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, _, err = run_main(["--checkpoint", str(d), "--prompt", "hi"], capsys)
    assert code == 2 and "truncated or corrupt" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("edit,message", [
    (lambda c: [1, 2], "is not a JSON object"),
    (lambda c: dict(c, vocab_size="abc"), "vocab_size must be a positive integer, got 'abc'"),
    (lambda c: dict(c, num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (lambda c: dict(c, model_type="mistral", sliding_window=0), "sliding_window must be a positive integer"),
    (lambda c: dict(c, rope_scaling={"rope_type": "linear"}), "rope_scaling linear lacks factor"),
    (lambda c: dict(c, rope_scaling={"rope_type": "llama3", "factor": 8}),
     "rope_scaling llama3 lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
], ids=["list", "vocab-type", "zero-heads", "zero-window", "linear-no-factor", "llama3-partial"])
def test_bad_config_values_one_line(tiny_ckpt, tmp_path, capsys, edit, message):
    """Malformed config.json values are named in one line (they used to raise from deep inside model building)."""
    d = tmp_path / "cfg"
    shutil.copytree(tiny_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    code, _, err = run_main(["--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "2"], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_no_traceback_as_a_process(tiny_ckpt):
    r = subprocess.run([sys.executable, str(REPO / "generate.py"), "--checkpoint", str(tiny_ckpt), "--prompt", "x",
                        "--policy", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


EAGER_IMPORTS = """
import json, sys
sys.path.insert(0, ".")
import generate
for argv in json.loads(sys.argv[1]):
    code = generate.main(argv)
    print("exit", code, "dynamo", "torch._dynamo" in sys.modules)
import torch
torch.compiler.assume_constant_result(lambda: 0)  # the control: the check sees an import of the compiler
print("control dynamo", "torch._dynamo" in sys.modules)
"""


def test_eager_run_never_imports_the_compiler(tiny_ckpt):
    """An eager generation (loading on the meta device, prefill, decode) never imports dynamo: ~70 MiB of RSS and
    ~1.3 s of startup that only --compile needs (model.on_meta, model.set_layer_regions, generate.py's counters).
    One process runs each policy in turn and looks after each run (a module once imported stays imported), then
    imports the compiler: the control, which the check must see."""
    policies = ["keydiff", "full"]
    runs = [["--checkpoint", str(tiny_ckpt), "--prompt", "the quick brown fox", "--policy", policy,
             *(["--budget", "32"] if policy != "full" else []), "--max-new-tokens", "3", "--quiet"]
            for policy in policies]
    r = subprocess.run([sys.executable, "-c", EAGER_IMPORTS, json.dumps(runs)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("exit ", "control "))]
    assert lines == ["exit 0 dynamo False"] * len(policies) + ["control dynamo True"], r.stdout + r.stderr[-2000:]


BENCH_BAD = [
    ("bench.py", ["--policies", "nope"], "unknown policy 'nope'"),
    ("bench_paired.py", ["--policies", "nope"], "unknown policy 'nope'"),
    ("bench_paired.py", ["--decode-steps", "1"], "--decode-steps must be >= 2"),
    ("bench.py", ["--no-compile-prefill"], "--no-compile-prefill needs --compile"),
    ("bench.py", ["--budget", "abc"], "invalid int value"),
    ("bench.py", ["--profile"], "unrecognized arguments: --profile"),
    ("bench_paired.py", ["--profile", "0"], "--profile needs >= 1"),
    ("bench.py", ["--threads", "0"], "--threads must be between 1 and 1024"),
    ("bench.py", ["--block-size", "0"], "--block-size must be >= 1"),
    ("bench_quant.py", ["--modes", ","], "--modes is empty"),
    ("bench_quant.py", ["--modes", "int3"], "unknown --modes entry 'int3'"),
    ("bench_figure.py", ["--contexts", "abc"], "comma-separated"),
    ("bench.py", ["--json", "/proc/x.json"], "--json /proc/x.json: cannot write"),
    ("bench.py", ["--policies", "sink", "--budget", "2"], "must exceed the 4 sink"),
    ("bench.py", ["--prompt-tokens", "9000"], "must fit the model's context (8192)"),
    ("bench.py", ["--prompt-tokens", "10", "--policies", "keydiff"], "is too small")]


def one_refusal_line(err: str) -> str:
    """The one line of a refusal (a fresh checkout converts the embedded model on first use, which says so on its own
    line), with no traceback."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("converting ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("script, extra, message", BENCH_BAD)
def test_bench_bad_policy_one_line_exit_2(script, extra, message, monkeypatch, capsys):
    """The benchmark scripts check their policy names and flags before loading anything: one line, exit 2, no
    traceback. Each case runs the script's main() in this process (the next test runs each script as a process)."""
    import importlib
    module = importlib.import_module(f"scripts.{script.removesuffix('.py')}")
    monkeypatch.setattr(sys, "argv", [script, *extra])  # the scripts' main() reads sys.argv
    try:
        code = module.main()
    except SystemExit as e:  # argparse's errors exit from inside parse_args
        code = e.code
    assert code == 2
    assert message in one_refusal_line(capsys.readouterr().err)


@pytest.mark.parametrize("script", sorted({script for script, _, _ in BENCH_BAD}))
def test_bench_refuses_as_a_process(script):
    """Each benchmark script as a user runs it: its first refusal above ends the process with exit code 2 and one
    line on stderr, no traceback."""
    extra, message = next((extra, message) for s, extra, message in BENCH_BAD if s == script)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), *extra], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert message in one_refusal_line(r.stderr)


def test_bench_paired_table_and_profile(tiny_ckpt):
    """bench_paired.py --compile on the tiny model: a row per configuration whose bandwidth-bound fraction is the
    step's bytes at the probed bandwidth over its step time, then --profile's kernel table of each configuration's
    compiled step: inductor's kernels by name, and no recompile (the profile runs under error_on_recompile)."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_paired.py"), "--checkpoint", str(tiny_ckpt),
                        "--compile", "--prompt-tokens", "120", "--budget", "32", "--block-size", "16",
                        "--decode-steps", "8", "--policies", "keydiff", "--profile", "40", "--threads", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    bw = float(re.search(r"read bandwidth \(probe next to each round\) median ([0-9.]+) GB/s", r.stdout).group(1))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in r.stdout.splitlines() if re.match(r"\| (no-evict|keydiff) \|", line)}
    assert list(rows) == ["no-evict", "keydiff"]
    assert rows["no-evict"][1] == "+0.0%"  # its own per-step ratio
    for label, (ms, _, _, mb, frac, _, _) in rows.items():
        # the median of per-step fractions against the fraction of the medians: the same within timing noise
        expected = float(mb) * 1e6 / (bw * 1e9) / (float(ms) / 1e3)
        assert 0.5 < float(frac.rstrip("%")) / 100 / expected < 2.0, (label, frac, expected)
    profiles = r.stdout.split("decode steps, top kernels by self time")[1:]
    assert len(profiles) == 2
    for p in profiles:  # the timed graphs' own kernels, named (cpp.enable_kernel_profile), and no compile in there
        assert re.search(r"graph_\d+_cpp_fused", p) and "dynamo_timed" not in p


@pytest.mark.parametrize("device,mode,want", [
    ("cuda", None, (None, "reduce-overhead")),  # auto: CUDA graphs for decode only
    ("cuda", "default", ("default", "default")),  # torch's default, no CUDA graphs (it used to mean auto)
    ("cuda", "reduce-overhead", (None, "reduce-overhead")),
    ("cuda", "max-autotune", ("max-autotune-no-cudagraphs", "max-autotune")),  # prefill never under CUDA graphs
    ("cuda", "max-autotune-no-cudagraphs", ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")),
    ("cpu", "max-autotune-no-cudagraphs", ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")),
    ("cpu", "default", ("default", "default")),
])
def test_compile_modes_of_the_two_steps(device, mode, want):
    from runtime import step_modes
    assert step_modes(device, mode) == want


def test_policy_help_lists_its_parameters(capsys):
    """`--policy NAME --help` prints the policy's rule and every parameter with its default; exit 0."""
    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--policy", "snapkv:window=8", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "snapkv" in out and "window (int, default 32)" in out and "kernel (int, default 7)" in out
    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--policy", "nope", "--help"])
    assert e.value.code == 2 and "unknown policy" in capsys.readouterr().err


def test_a_python_without_the_requirements_gets_one_line(monkeypatch):
    import errors
    monkeypatch.setattr(errors, "REQUIRED", ("torch", "no_such_module_budgetkv"))
    with pytest.raises(SystemExit) as e:
        errors.check_python()
    assert str(e.value).startswith("error: no_such_module_budgetkv not installed in this Python")
    assert ".venv/bin/python" in str(e.value)


@pytest.mark.parametrize("script", ["generate.py", "scripts/bench.py", "scripts/eval.py", "scripts/quantize.py",
                                    "scripts/convert_hf_checkpoint.py", "scripts/download.py", "scripts/gpu_check.py",
                                    "scripts/bench_compile.py"])
def test_every_command_line_says_in_one_line_that_this_python_lacks_the_requirements(script):
    """python -S: no site-packages, so none of the requirements: one line and exit 1, no traceback."""
    r = subprocess.run([sys.executable, "-S", script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "not installed in this Python" in r.stderr and "torch" in r.stderr


def test_threads_follow_the_other_processes_load(monkeypatch):
    """Adaptive: every usable core while the others are idle, one fewer per core of other work (from 0.6 of a core
    on), back up once it is gone; judged at most once an INTERVAL; a fixed count never moves."""
    import runtime
    clock, samples, set_to = [100.0], [], []
    monkeypatch.setattr(runtime.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runtime, "load_sample", lambda: samples[-1])
    monkeypatch.setattr(runtime, "usable_cores", lambda: 2)
    monkeypatch.setattr(runtime, "omp_num_threads", lambda: None)
    monkeypatch.setattr(runtime.torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(runtime.torch, "get_num_threads", lambda: set_to[-1])
    hz = os.sysconf("SC_CLK_TCK")
    t = runtime.Threads()
    t.start()
    busy, own, counts = 0, 0, []
    for others, ours in ((0.0, 2.0), (1.0, 1.0), (0.5, 1.0), (0.9, 1.0), (0.0, 2.0), (0.0, 2.0)):
        busy, own = busy + int((others + ours) * hz), own + int(ours * hz)
        samples.append((busy, own))
        t.tick()
        counts.append(t.count)
        clock[0] += 0.4  # within the interval: not judged again
        t.tick()
        clock[0] += 0.6
    # the first tick only takes a reading; then 1.0 core of other work -> 1, 0.5 -> back to 2, 0.9 -> 1, idle -> 2
    assert counts == [2, 1, 2, 1, 2, 2]
    assert [c[1] for c in t.changes] == [1, 2, 1, 2] and t.report()["thread_policy"] == "adaptive (up to 2)"
    assert t.report()["thread_moves"] == 4
    fixed = runtime.Threads()
    fixed.start(2)
    samples.append((busy + 10 * hz, own))
    fixed.tick()
    clock[0] += 2
    fixed.tick()
    assert fixed.count == 2 and not fixed.changes and fixed.report()["thread_policy"] == "fixed"
    monkeypatch.setattr(runtime, "omp_num_threads", lambda: 1)  # OMP_NUM_THREADS set by the user: fixed
    from_env = runtime.Threads()
    from_env.start()
    assert (from_env.fixed, from_env.count) == (1, 1)


def test_other_cores_and_the_cgroup_quota(tmp_path):
    import runtime
    hz = os.sysconf("SC_CLK_TCK")
    assert runtime.other_cores((100, 40), (100 + 3 * hz, 40 + hz), 2.0) == 1.0  # 3 core-s busy, 1 ours, in 2 s
    assert runtime.other_cores((100, 40), (100 + hz, 40 + 2 * hz), 1.0) == 0.0  # never negative
    v2, v1, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    v2.write_text("150000 100000\n")
    assert runtime.cgroup_quota([(str(v2), None)]) == 1.5
    v2.write_text("max 100000\n")
    assert runtime.cgroup_quota([(str(v2), None)]) is None
    v1.write_text("-1\n")
    period.write_text("100000\n")
    assert runtime.cgroup_quota([(str(tmp_path / "none"), None), (str(v1), str(period))]) is None
    v1.write_text("50000\n")
    assert runtime.cgroup_quota([(str(v1), str(period))]) == 0.5


ADAPTIVE = """
import json, sys, time, torch
sys.path.insert(0, {repo!r})
import engine, loading, runtime
model = loading.load_model({ckpt!r}, "float32", "cpu")
gen = engine.Generation(model.args, None, [64], max_new_tokens=64, block_size=16)
gen.setup(model)
t = time.monotonic()
while time.monotonic() - t < 3:
    gen.generate(model, [list(range(1, 65))])
print(json.dumps(runtime.THREADS.report()))
"""


def test_a_run_beside_a_busy_process_uses_fewer_threads(tiny_ckpt):
    """A run of a few seconds in a fresh process (no OMP_NUM_THREADS: adaptive) beside a busy process at the lowest
    priority (/proc/stat counts it busy either way; it takes no core from the suite's other worker): its count moves
    below every usable core, and its stats say so. Nothing is set in the environment when engine is imported, torch
    before it or after."""
    import runtime
    usable = runtime.usable_cores()
    if usable == 1:
        pytest.skip("one usable core: nothing to move")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
    try:
        r = subprocess.run([sys.executable, "-c", ADAPTIVE.format(repo=str(REPO), ckpt=str(tiny_ckpt))], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        spinner.kill()
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["thread_policy"] == f"adaptive (up to {usable})" and report["thread_changes"], report
    assert min(c[1] for c in report["thread_changes"]) < usable and report["wait_policy"].startswith("default")
    for order in ("import torch, engine", "import engine, torch"):
        out = subprocess.run([sys.executable, "-c", f"import os, sys; {order}; print(sorted(k for k in os.environ if "
                              f"k.startswith(('OMP_', 'GOMP_'))))"], cwd=REPO, env=env, capture_output=True, text=True)
        assert out.stdout.strip() == "[]", out.stderr


def test_the_summary_names_the_weight_format_and_source():
    assert generate.weights_format({}, "float32") == "float32"
    q = {"budgetkv_quantization": {"mode": "int4", "groupsize": 32}, "source": "converted from m.gguf (Q4_1 weights, "
         "dequantized to float32)"}
    assert generate.weights_format(q, "bfloat16") == ("int4 (group 32) weights, bfloat16 activations [converted from "
                                                       "m.gguf (Q4_1 weights, dequantized to float32)]")
    assert generate.weights_format({"budgetkv_quantization": {"mode": "int8"}}, "float32") == \
        "int8 weights, float32 activations"


def test_bench_compile_measures_eager_cold_and_warm(tiny_ckpt, tmp_path, capsys):
    """scripts/bench_compile.py: generate.py runs as a user runs them; the warm run finds the cold run's graphs in
    the cache, the JSON holds every run and the break-even, and bad sizes are one line. Compiled steps survive the
    process: torch.compile's graphs are not frozen (a frozen CPU graph holds oneDNN tensors that inductor's cache
    cannot store), so the warm process finds every graph in the cold one's cache, says so in its summary and
    generates the same tokens; inductor's noise goes to the compile log, not the terminal (bench_compile.py passes
    each run's stderr on). The AOT package's second process: test_aoti.py's cli_runs."""
    out = tmp_path / "compile.json"
    argv = [sys.executable, str(REPO / "scripts" / "bench_compile.py"), "--checkpoint", str(tiny_ckpt),
            "--policy", "keydiff", "--budget", "8", "--prompt-tokens", "100", "--new-tokens", "4", "--repeats", "1",
            "--threads", "1", "--compile-mode", "default"]
    caches_before = set((REPO / "build").glob("bench-compile-cache-*"))
    r = subprocess.run(argv + ["--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=env_with_tmpdir(tmp_path))
    assert r.returncode == 0, r.stderr
    # bench_compile.py's own progress line per run, nothing from inductor or the C++ compiler in generate.py's runs
    assert [line.split(":")[0] for line in r.stderr.splitlines()] == ["  cold", "  eager", "  warm"], r.stderr
    assert (tmp_path / f"budgetkv-{os.getuid()}" / "compile.log").is_file()
    runs = json.loads(out.read_text())["runs"]
    assert [x["run"] for x in runs] == ["cold", "eager", "warm"]
    assert [x["compile_cache"] for x in runs] == ["miss", None, "hit"]
    assert [x["compile_mode"] for x in runs] == ["default", None, "default"]
    assert runs[0]["token_ids"] == runs[2]["token_ids"]
    assert all(x["generated_tokens"] == runs[0]["generated_tokens"] for x in runs)
    assert len({x["prompt_tokens"] for x in runs}) == 1 and 60 < runs[0]["prompt_tokens"] <= 100
    assert not any(x["weights"].startswith("random") for x in runs)
    assert "| warm |" in r.stdout and "--compile pays off from" in r.stdout
    assert set((REPO / "build").glob("bench-compile-cache-*")) == caches_before  # the cold run's cache is removed
    from scripts import bench_compile  # bad sizes in this process: the run above is the script as a process
    capsys.readouterr()
    assert bench_compile.main(argv[2:] + ["--prompt-tokens", "10"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: need --prompt-tokens >= 64, --new-tokens >= 2 and --budget >= 1"]


def test_bench_compile_runs_random_weights_on_the_checkpoints_shapes(tiny_ckpt, tmp_path):
    """bench_compile.py --random-weights: each generate.py run gets the checkpoint's shapes and a prompt of
    --prompt-tokens random ids (a GPU's llama3.1-8b without its files). One eager run of the script's own command:
    the cold and warm runs add only --compile to it, which the test above runs end to end."""
    from scripts import bench_compile
    shapes = tmp_path / "shapes"  # the shapes only: a folder with the config alone
    shapes.mkdir()
    shutil.copy(tiny_ckpt / "config.json", shapes / "config.json")
    args = bench_compile.parser().parse_args(["--checkpoint", str(shapes), "--policy", "keydiff", "--budget", "8",
                                              "--prompt-tokens", "100", "--new-tokens", "4", "--threads", "1",
                                              "--random-weights"])
    run = bench_compile.generate_run(args, None, tmp_path / "cache", compiled=False)
    assert run["weights"].startswith("random") and run["prompt_tokens"] == 100
    assert run["generated_tokens"] == 4 and run["compile_cache"] is None


def test_python_api_generates_what_the_command_line_does(tiny_ckpt, tmp_path, capsys):
    """engine.generate_text, one call from any working directory (PYTHONPATH = the repository): the command line's
    defaults (the budget's 2048 clamped to the context of 256) and its tokens, for one prompt and in a batch."""
    import engine
    prompt = "the quick brown fox jumps over the lazy dog, " * 3
    code, out, err = run_main(["--checkpoint", str(tiny_ckpt), "--prompt", prompt, "--json", "--policy", "keydiff",
                               "--max-new-tokens", "6", "--block-size", "4"], capsys)
    assert code == 0, err
    cli = json.loads(out)
    api = engine.generate_text(prompt, checkpoint=str(tiny_ckpt), policy="keydiff", max_new_tokens=6, block_size=4)
    assert (api["text"], api["token_ids"]) == (cli["text"], cli["token_ids"]) and len(api["token_ids"]) == 6
    assert api["budget"] == cli["budget"] == 256 and api["clamped_to_context"] == cli["clamped_to_context"]
    batch = engine.generate_text([prompt, "the lazy dog"], checkpoint=str(tiny_ckpt), policy="keydiff",
                                 budget=8, max_new_tokens=6, block_size=4)
    alone = engine.generate_text("the lazy dog", checkpoint=str(tiny_ckpt), policy="keydiff", budget=8,
                                 max_new_tokens=6, block_size=4)
    assert batch["batch_size"] == 2 and batch["token_ids"][1] == alone["token_ids"]
    code = f"import engine; print(engine.generate_text({prompt!r}, checkpoint={str(tiny_ckpt)!r}, " \
           "policy='keydiff', max_new_tokens=6, block_size=4)['token_ids'])"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == cli["token_ids"]


# ---------------------------------------------------------------------------------- SIGTERM and child processes

def long_with_tempfile(tmp_path, signum):
    """A command whose work holds a temporary file in a `with` block while the signal arrives."""
    import tempfile
    made = []

    def run(a):
        with tempfile.NamedTemporaryFile(dir=tmp_path) as f:
            made.append(Path(f.name))
            os.kill(os.getpid(), signum)
            time.sleep(60)
    return run, made


def long_aot_compile(tmp_path, signum, monkeypatch):
    """aoti.compile_package signalled while its compiler (faked, in its fork) writes into its temporary folder:
    the fork is ended with it."""
    import torch._inductor

    import aoti

    def compile_and_package(ep, package_path):
        Path(package_path).write_bytes(b"half a package")
        os.kill(os.getppid(), signum)  # the process that runs the command, from its fork
        time.sleep(60)
    monkeypatch.setattr(aoti, "export_step", lambda *a: None)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    return lambda a: aoti.compile_package(None, None, None, tmp_path / "steps" / "k.pt2", [], print), []


SIGNAL_DURING_FORK = """
import argparse, logging, os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch._inductor
import aoti, cli
os.register_at_fork(after_in_parent=lambda: time.sleep(1))  # the parent slow in os.fork()'s Python hooks


def compile_and_package(ep, package_path):
    os.kill(os.getppid(), signal.SIGTERM)  # at once, while the parent is still in those hooks
    time.sleep(60)
aoti.export_step = lambda *a: None
torch._inductor.aoti_compile_and_package = compile_and_package
code = cli.run_cli(lambda a: aoti.compile_package(None, None, None, Path(sys.argv[2]) / "k.pt2", [], print),
                   argparse.Namespace())
free = []  # logging's lock, taken in os.fork()'s hooks: free for another thread after the run
t = threading.Thread(target=lambda: free.append(logging._lock.acquire(timeout=5) and logging._lock.release() is None))
t.start(), t.join()
print("logging's lock free:", free)
sys.exit(code)
"""


def test_a_signal_while_the_compile_forks_is_not_lost(tmp_path):
    """SIGTERM arriving while os.fork() runs its Python hooks in the parent (any load can stretch that moment) ends
    the run as any SIGTERM does, at once. Raised inside a hook, it was swallowed there: the run waited out the
    compile, and logging's lock, which a hook releases, stayed taken, so that any later logging from another thread
    (huggingface_hub's download threads) waited for ever."""
    r = subprocess.run([sys.executable, "-c", SIGNAL_DURING_FORK, str(REPO), str(tmp_path)], capture_output=True,
                       text=True, timeout=50)
    assert (r.returncode, r.stderr, r.stdout) == (128 + signal.SIGTERM, "terminated\n", "logging's lock free: [True]\n")


SIGNAL_DURING_START = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import cli
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM))  # a SIGTERM in the fork's hooks
try:
    with cli.terminated_raises():
        p = cli.start_child(["sleep", "30"])
        print("the signal was lost")
        cli.stop_child(p)
except cli.Terminated:
    print("terminated")
"""


def test_a_signal_while_a_child_starts_is_not_lost():
    """cli.start_child forks through Python's hooks (its preexec_fn): a SIGTERM arriving there is raised after the
    fork, not lost inside a hook."""
    r = subprocess.run([sys.executable, "-c", SIGNAL_DURING_START, str(REPO)], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == "terminated\n", r.stdout + r.stderr


def long_atomic_write(tmp_path, signum):
    """files.write_atomic signalled while it writes its temporary file."""
    import files

    def write(tmp):
        tmp.write_text("half")
        os.kill(os.getpid(), signum)
        time.sleep(60)
    return lambda a: files.write_text(tmp_path / "out.txt", "") or files.write_atomic(tmp_path / "out.txt", write), []


@pytest.mark.parametrize("work,signum", [("tempfile", signal.SIGTERM), ("tempfile", signal.SIGHUP),
                                         ("aot compile", signal.SIGTERM), ("atomic write", signal.SIGTERM)])
def test_sigterm_ends_a_command_through_its_cleanup(tmp_path, monkeypatch, capfd, work, signum):
    """SIGTERM (or SIGHUP) during a long run_cli command: its `finally` blocks and context managers run (a
    temporary file, aoti's budgetkv-aot-* folder, files.write_atomic's .budgetkv-tmp-* file are removed), one line
    `terminated`, exit 128 + the signal; the signal's handler is the old one again afterwards."""
    import argparse
    import tempfile

    import cli
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run, made = {"tempfile": lambda: long_with_tempfile(tmp_path, signum),
                 "aot compile": lambda: long_aot_compile(tmp_path, signum, monkeypatch),
                 "atomic write": lambda: long_atomic_write(tmp_path, signum)}[work]()
    before = signal.getsignal(signum)
    code = cli.run_cli(run, argparse.Namespace())
    assert (code, capfd.readouterr().err) == (128 + signum, "terminated\n")
    assert signal.getsignal(signum) == before
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file() or p.name.startswith("budgetkv-aot-"))
    assert left == (["out.txt"] if work == "atomic write" else []), left
    assert made == [] or not made[0].exists()


def alive_children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else None
        except OSError:
            continue
        if fields and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def gone(pids: list[int]) -> bool:
    def alive(pid):
        try:
            return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
        except OSError:
            return False
    return not any(alive(p) for p in pids)


def signal_once_children_run(cmd: list[str], signum, want=lambda pid: True, **kw):
    """Start cmd, wait until a child of it that `want` accepts runs, send the signal; (the process after it ended,
    its stderr, the children seen, whether they are gone within 15 s)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        deadline = time.monotonic() + 120
        while not (kids := [c for c in alive_children(p.pid) if want(c)]):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no child process started"
            time.sleep(0.05)
        p.send_signal(signum)
        _, err = p.communicate(timeout=60)
        deadline = time.monotonic() + 15
        while not gone(kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return p, err, kids, gone(kids)
    finally:
        p.kill()
        for c in alive_children(p.pid):
            os.kill(c, signal.SIGKILL)


FAKE_BENCH_THREADS = """
import json, os, sys
sys.path.insert(0, {repo!r})
from scripts import bench_threads
calls = []
stats = dict(decode_tok_s=1.0, prefill_tok_s=1.0, threads=1, thread_policy="fixed", thread_changes=[])
def command(setting, mode, case, prompt, a):  # the untimed run, then the busy one, beside its spinner: it never ends
    calls.append(1)
    code = "import time; time.sleep(600)" if len(calls) == 2 else f"print({{json.dumps(stats)!r}})"
    return [sys.executable, "-c", code], dict(os.environ)
bench_threads.command = command
sys.exit(bench_threads.main(["--modes", "eager", "--settings", "default", "--cases", "busy", "--repeats", "1"]))
"""


@pytest.mark.parametrize("child,signum", [("generate.py", signal.SIGTERM), ("spinner", signal.SIGTERM),
                                          ("spinner", signal.SIGKILL)])
def test_bench_threads_leaves_no_process_behind(child, signum):
    """scripts/bench_threads.py stopped while its child runs (a generate.py run, or the busy loop beside the busy
    runs): the child is gone within seconds; SIGTERM is `terminated`, exit 143. SIGKILL, which no cleanup sees: the
    child gets SIGTERM from the kernel (PR_SET_PDEATHSIG, cli.dies_with_parent)."""
    if child == "generate.py":
        cmd = [sys.executable, str(REPO / "scripts" / "bench_threads.py"), "--modes", "eager", "--settings",
               "default", "--cases", "file", "--repeats", "1", "--prompt-bytes", "10", "--new-tokens", "2"]
    else:
        cmd = [sys.executable, "-c", FAKE_BENCH_THREADS.format(repo=str(REPO))]
    p, err, kids, ended = signal_once_children_run(cmd, signum)
    assert ended, f"left behind: {kids}"
    if signum == signal.SIGTERM:
        assert p.returncode == 143 and err.strip().splitlines()[-1] == "terminated", (p.returncode, err)


SPINNERS_SEEN = """
import json, os, time
def spinners():  # busy processes that the bench (this run's parent) has running now
    n = 0
    for d in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid())}:
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            n += ppid == os.getppid() and b"while True: pass" in open(f"/proc/{d}/cmdline", "rb").read()
        except (OSError, IndexError, ValueError):
            pass
    return n
seen = []
for t in (0.5, 3.5):
    time.sleep(t - (seen and 0.5 or 0))
    seen.append(spinners())
print(json.dumps({"seen": seen}))
"""


@pytest.mark.parametrize("case,seen", [("busy", [1, 1]), ("busy later", [0, 1]), ("busy ends", [1, 0])])
def test_bench_threads_busy_process_spins_when_its_case_says(monkeypatch, tmp_path, case, seen):
    """bench_threads' busy process, seen from the run at 0.5 s and 3.5 s: there throughout (`busy`), from 2 s
    (`busy later`: started from the main thread, since a child dies with the thread that started it), until 2 s
    (`busy ends`)."""
    from scripts import bench_threads
    monkeypatch.setattr(bench_threads, "command", lambda *a: ([sys.executable, "-c", SPINNERS_SEEN], dict(os.environ)))
    assert bench_threads.run_generate("default", "eager", case, tmp_path / "prompt.txt", None) == {"seen": seen}


def test_bench_leaves_no_measuring_child_behind(tiny_ckpt, tmp_path):
    """scripts/bench.py stopped by SIGTERM while a configuration is measured in its child process: the child gets
    SIGTERM and is gone within seconds; the script says `terminated`, exit 143."""
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    shutil.copy(tiny_ckpt / "config.json", shapes)
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--checkpoint", str(shapes), "--random-weights",
           "--policies", "keydiff", "--prompt-tokens", "64", "--budget", "16", "--block-size", "16",
           "--decode-steps", "2", "--repeats", "1", "--device", "cpu", "--threads", "1"]
    p, err, kids, ended = signal_once_children_run(cmd, signal.SIGTERM)
    assert ended, f"left behind: {kids}"
    assert p.returncode == 143 and err.strip().splitlines()[-1] == "terminated", (p.returncode, err)


class Parsed(Exception):
    """Raised by a command line's parse_args in test_every_flag_has_help_with_its_default: carries the parser."""


def command_line_parser(script: str, monkeypatch):
    """The argparse parser `script` (generate.py or scripts/NAME.py) builds, taken when it parses."""
    import argparse
    import importlib

    def grab(self, *args, **kw):
        raise Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    mod = generate if script == "generate.py" else importlib.import_module(f"scripts.{Path(script).stem}")
    with pytest.raises(Parsed) as got:
        if hasattr(mod, "parser"):
            mod.parser().parse_args([])
        elif hasattr(mod, "parse_args"):
            mod.parse_args([])
        else:
            mod.main([])
    return got.value.args[0]


SCRIPTS_WITH_FLAGS = ["generate.py", *sorted(str(p.relative_to(REPO)) for p in (REPO / "scripts").glob("*.py")
                                              if "parse_args" in p.read_text())]


@pytest.mark.parametrize("script", SCRIPTS_WITH_FLAGS)
def test_every_flag_has_help_with_its_default(script, monkeypatch):
    """--help explains every flag and argument and shows each default a flag has (bench.py showed neither for its
    main flags)."""
    import argparse

    from cli import shows_default
    ap = command_line_parser(script, monkeypatch)
    for action in ap._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        formatter = ap._get_formatter()
        formatter.add_argument(action)
        text = " ".join(formatter.format_help().split())
        assert action.help, f"{script}: {text} has no help"
        if shows_default(action) and action.option_strings:
            assert "default" in text.lower(), f"{script}: {text} does not show its default ({action.default})"


def test_make_vectors_help_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_vectors.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tests/vectors" in r.stdout, r.stderr
    assert list(tmp_path.iterdir()) == []  # it wrote 81 cases into a folder named --help


@pytest.mark.parametrize("flag", [["--hf-tok", "hf_abbreviated_flag"], ["--hf=hf_abbreviated_flag"]],
                         ids=["apart", "equals"])
def test_the_error_log_redacts_an_abbreviated_secret_flag(tmp_path, monkeypatch, capfd, flag):
    """argparse takes --hf-tok or --hf for --hf-token: the parsed value is redacted, not only --hf-token's."""
    import tempfile

    import cli
    from scripts import download
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cli, "PARSED_SECRETS", [])
    argv = ["--repo-id", "a/b", *flag]
    monkeypatch.setattr(sys, "argv", ["scripts/download.py", *argv])
    assert download.parse_args(argv).hf_token == "hf_abbreviated_flag"
    assert cli.internal_error(ValueError("refused for hf_abbreviated_flag"), False) == 1
    log = (tmp_path / f"budgetkv-{os.getuid()}" / "error.log").read_text()
    assert "hf_abbreviated_flag" not in log and "ValueError: refused for ***" in log


@pytest.mark.parametrize("verbose", [False, True], ids=["line", "verbose"])
def test_an_error_line_holds_no_secret(tmp_path, monkeypatch, capfd, verbose):
    """A secret of the command line in an exception's message is *** on stderr too: the internal error's line or
    -v's traceback, and a bad input's line."""
    import tempfile

    import cli
    from errors import UserError
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["scripts/download.py", "--hf-token", "hf_in_the_message"])
    cli.internal_error(ValueError("refused for hf_in_the_message"), verbose)

    def refuse(a):
        raise UserError("bad token hf_in_the_message")
    assert cli.run_cli(refuse, argparse.Namespace(verbose=verbose)) == 2
    err = capfd.readouterr().err
    assert "hf_in_the_message" not in err and "refused for ***" in err and "bad token ***" in err

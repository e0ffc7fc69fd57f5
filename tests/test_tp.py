"""Tensor parallel (tp.py) on CPU with gloo: 2 ranks started from here (tests/tp_worker.py under torchrun, or two
processes with torchrun's environment), tiny GQA models with 2 and 4 KV heads, fp32.

- every registered policy, under each protocol it allows, eager: TP=2 greedy tokens equal TP=1's token for token,
  every step's logits within fp32 rounding (wo's and w2's sums split over 2 ranks), each rank's kept positions
  per layer equal the TP=1 sets of the same KV heads; the reference's top-1 margin at every step is asserted to be
  far above the logit difference, so that equal tokens are not luck;
- compiled (fullgraph, error_on_recompile, functional all-reduce inside the graph): tova:heads=all block-wise (the
  prefill and decode steps of an evicting scorer, an all-gather in each): docs/testing.md says why this one;
- int8 / int4 weights: sharded with their scales (tokens, logits, kept sets on the fp32 dequantize kernels; each
  sharded Linear on the fused bfloat16 kernels against the whole one);
- the command line under torchrun: only rank 0 prints, the summary's per-rank KV bytes, the tokens of one process;
  bad input (world-size mismatch, --device cuda without CUDA, 2 ranks for 1 KV head, an int4 group size, too few
  GPUs): one line on rank 0, exit 2 on rank 0 and 0 on rank 1, no hang; a prompt from a pipe reaches both ranks; a
  lost rank does not hang the other (the group's timeout); a policy's refusal (none of the registered ones refuses:
  K-VEC and tova:heads=all gather the heads they read) is one line.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

from tp_worker import MODELS, cases

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def torchrun(args: list, timeout: int, input: str | None = None, **extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=REPO, env=env(**extra), capture_output=True, text=True, timeout=timeout,
                          input=input)


def suites(names: str, out, timeout: int) -> list[dict]:
    """Run tests/tp_worker.py's suites (comma-separated) in one torchrun of 2 ranks; each rank's results per suite."""
    p = torchrun(["tests/tp_worker.py", str(out), names], timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The eager, quantized-weights and compiled suites, from one torchrun (one start of the ranks and one process
    group for all); the compiled suite runs last, between torch._dynamo.reset calls of its own."""
    t = time.perf_counter()
    res = suites("eager,quant,compiled", tmp_path_factory.mktemp("tp_worker"), timeout=1200)
    print(f"eager, quant and compiled suites: {time.perf_counter() - t:.1f} s")
    return res


@pytest.fixture(scope="module")
def eager(worker):
    return [rank["eager"] for rank in worker]


def check_case(r: dict) -> None:
    assert r["tp"] == r["ref"], r
    assert r["kept_equal"], r
    assert r["logit_diff"] < 1e-5, r
    # equal tokens are meaningful only where the reference's top two logits are far apart
    assert r["min_margin"] > 20 * r["logit_diff"], r


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("spec,prefill", cases())
def test_tp2_equals_tp1(eager, model, spec, prefill):
    for rank in (0, 1):
        check_case(eager[rank][f"{model}|{spec}|{prefill}"])


def test_every_policy_is_covered():
    """A new policy in the registry is in the TP cases (or the test must say why not)."""
    import policies
    covered = {spec for spec, _ in cases()}
    assert set(policies.REGISTRY) | {"full"} <= covered


def test_compiled(worker):
    """The compiled steps under TP=2: fullgraph, the all-reduces inside the graph, no recompile over two
    generations, the eager TP=1 tokens and kept sets. Rank 0 compiles the 2 graphs and rank 1 then loads them
    from inductor's cache (tp_worker.compiling_in_turn): about a minute cold on 2 cores, seconds from
    build/inductor-cache."""
    for rank_results in worker:
        assert len(rank_results["compiled"]) == 2  # the decode step's explain and the compiled run
        for key, r in rank_results["compiled"].items():
            if key.endswith("explain"):  # one graph, no break, 2 all-reduces per layer (2 layers) inside it,
                gathers = 2 if "heads=all" in key else 0  # and tova:heads=all's all-gather per layer
                assert r == dict(graphs=1, breaks=0, all_reduces=4, all_gathers=gathers), (key, r)
                continue
            check_case(r)
            assert r["again"] == r["tp"], key


def test_quantized_weights_shard(worker):
    for rank_results in worker:
        assert len(rank_results["quant"]) == 4  # keydiff block-wise and snapkv++ one-shot, int8 and int4
        for key, r in rank_results["quant"].items():
            check_case(r)
            mode = key.split("|")[-1]
            assert r["wqkv_type"] == ("Int8Linear" if mode == "int8" else "Int4Linear")
            assert r["wqkv_out"] == (4 + 2 * 2) * 16 // 2  # (q heads + k + v heads) x head_dim / 2 ranks
            assert r["kernels"][1] == r["kernels"][0]  # the shards run the whole model's fused kernels
            errs = r["fused_rel_err"]
            assert errs["wqkv"] == 0.0 and errs["w13"] == 0.0, errs  # column slices: exactly the same outputs
            assert errs["wo"] < 1e-2 and errs["w2"] < 1e-2, errs  # partial sums each rounded to bfloat16


# ----------------------------------------------------------------------------------------------- command line

def tiny_config(tmp_path, **over):
    from conftest import FAMILIES
    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(FAMILIES["llama"], tie_word_embeddings=True, **over)))
    return d


def gen_args(ckpt, *extra) -> list:
    return ["--checkpoint", str(ckpt), "--random-weights", "--prompt-tokens", "60", "--budget", "32",
            "--block-size", "16", "--max-new-tokens", "6", "--threads", "1", *extra]


def one_process(args: list, capsys) -> dict:
    """generate.py's JSON summary for args, run in this process (one device, no torchrun environment)."""
    import generate
    code = generate.main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_cli_under_torchrun(tmp_path, capsys):
    """torchrun --nproc-per-node 2 generate.py: one JSON object (rank 0 only), the tokens of one process, per-rank
    and total KV bytes (each rank half the KV heads), weights (its shard) and peaks."""
    ckpt = tiny_config(tmp_path)
    args = gen_args(ckpt, "--policy", "snapkv:window=8", "--json")
    want = one_process(args, capsys)
    p = torchrun(["generate.py", *args, "--tp", "2"], 180)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, p.stdout
    got = json.loads(lines[0])
    assert got["token_ids"] == want["token_ids"]
    assert got["tp_world"] == 2
    assert got["kv_cache_bytes_per_rank"] == [want["kv_cache_bytes"] // 2] * 2
    assert got["kv_cache_bytes_total"] == want["kv_cache_bytes"]
    assert len(got["peak_bytes_per_rank"]) == 2 and min(got["peak_bytes_per_rank"]) > 0
    import tp  # each rank built only its shard of the random weights (tp.random_model), with one process's values
    config = json.loads((ckpt / "config.json").read_text())
    assert got["weight_bytes_per_rank"] == [tp.weight_bytes_per_rank(config, 2, torch.float32)] * 2


def test_a_rank_log_that_cannot_be_opened_is_one_line(tmp_path):
    """Rank 1's log path is a folder: rank 1 says in one line where its stderr goes instead (a private file of a
    unique name) and the run goes on; no traceback, no torchrun report."""
    log = tmp_path / f"budgetkv-{os.getuid()}" / "rank1.log"
    log.mkdir(parents=True)
    log.parent.chmod(0o700)
    p = torchrun(["generate.py", *gen_args(tiny_config(tmp_path), "--policy", "keydiff", "--json")], 180,
                 TMPDIR=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = p.stderr.splitlines()
    other = re.fullmatch(rf"note: rank 1: cannot use {log}: Is a directory: its stderr goes to (\S+)", line).group(1)
    assert other.startswith(f"{tmp_path}/budgetkv-rank1-") and os.stat(other).st_mode & 0o777 == 0o600
    assert json.loads(p.stdout)["tp_world"] == 2


def test_a_prompt_from_a_pipe_reaches_every_rank(hf_tiny, tmp_path):
    """--prompt-file - under torchrun: rank 0 reads the pipe and sends the prompt to rank 1 (ranks.from_rank0), so both
    ranks generate from the whole prompt: the tokens of one process reading the same pipe. An empty pipe is refused
    on both ranks: one line, exit 2 on rank 0 alone, no hang."""
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    tiny = with_tiny_tokenizer(src, tmp_path / "tok", "the quick brown fox jumps over the lazy dog")
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    args = ["generate.py", "--checkpoint", str(tiny), "--prompt-file", "-", "--max-new-tokens", "5", "--json",
            "--threads", "1"]
    one = subprocess.run([sys.executable, *args], cwd=REPO, env=env(), input=prompt, capture_output=True, text=True,
                         timeout=180)
    assert one.returncode == 0, one.stderr
    p = torchrun(args, 180, input=prompt)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = json.loads(p.stdout), json.loads(one.stdout)
    assert got["tp_world"] == 2 and (got["token_ids"], got["prompt_tokens"]) == (want["token_ids"],
                                                                                 want["prompt_tokens"])
    p = torchrun(args, 180, input="")
    assert p.returncode == 1 and [ln for ln in p.stderr.splitlines() if ln.startswith("error")] == [
        "error: prompt file - is empty"], p.stderr
    assert p.stderr.count("exitcode  : 2") == 1, p.stderr  # rank 0 only: rank 1 refused it too, and exits 0


REPORT_LINES = 42  # torchrun's report after a failed rank: 33 lines naming rank 0; 7 more for a rank it stopped


def test_bad_input_under_torchrun_is_a_failure_with_a_short_report(tmp_path):
    """A bad flag under torchrun: one line from rank 0, and torchrun exits non-zero with a report that names rank 0
    (exit 2) and no other rank that refused the input (they exit 0): at most REPORT_LINES lines in all, where a rank
    torchrun stopped while it was still starting adds its own entry."""
    p = torchrun(["generate.py", *gen_args(tiny_config(tmp_path), "--budget", "0")], 180)
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and len(lines) <= REPORT_LINES, p.stderr
    assert [ln for ln in lines if ln.startswith("error")] == ["error: --budget must be >= 1, got 0"]
    assert p.stderr.count("exitcode  : 2") == 1 and "rank      : 0 (local_rank: 0)" in p.stderr, p.stderr


def test_cli_loads_checkpoints(hf_tiny, tmp_path, capsys):
    """A float checkpoint on 2 ranks (torchrun's environment; torchrun itself: test_cli_under_torchrun) gives one
    process's tokens; an int4 one (quantized Linears sharded before they are packed for the CPU kernel) runs; an
    int4 group size that does not divide a rank's in-features of wo (64 > 32) is one line, exit 2 on rank 0 and 0 on
    rank 1 (ranks.exit_code: torchrun's report names rank 0 alone); rank 1 prints nothing."""
    from conftest import with_tiny_tokenizer
    from quantize import quantize_dir
    _, src = hf_tiny("llama")
    tiny = with_tiny_tokenizer(src, tmp_path / "tok", "the quick brown fox jumps over the lazy dog")
    args = ["--prompt", "the quick brown fox", "--max-new-tokens", "5", "--json", "--threads", "1"]
    one = one_process(["--checkpoint", str(tiny), *args], capsys)
    runs = {"float": ["--checkpoint", str(tiny), *args]}
    for groupsize in (32, 64):
        quantize_dir(tiny, "int4", groupsize, out=tmp_path / f"int4-g{groupsize}")
        runs[f"int4-g{groupsize}"] = ["--checkpoint", str(tmp_path / f"int4-g{groupsize}"), *args]
    ranks = two_ranks(runs, tmp_path, timeout=300)
    r0, r1 = ranks["float"]
    assert (r0.returncode, r1.returncode) == (0, 0), r0.stderr + r1.stderr
    assert json.loads(r0.stdout)["token_ids"] == one["token_ids"] and r1.stdout == r1.stderr == ""
    for groupsize, refused in ((32, False), (64, True)):
        r0, r1 = ranks[f"int4-g{groupsize}"]
        assert (r0.returncode, r1.returncode) == (2 if refused else 0, 0), r0.stderr + r1.stderr
        if not refused:
            got = json.loads(r0.stdout)
            assert got["generated_tokens"] == 5 and got["tp_world"] == 2
        else:
            assert r0.stderr.strip().splitlines() == [
                "error: int4 group size 64 does not divide a rank's 32 in-features of a row-parallel Linear: use a "
                "smaller --groupsize or fewer ranks"]
        assert r1.stdout == r1.stderr == ""


def test_bench_tp(tmp_path):
    """scripts/bench_tp.py under torchrun: one JSON line from rank 0 with each rank's step times and all-reduce
    share (between 0 and 1: the step without the collectives is the faster one)."""
    p = torchrun(["scripts/bench_tp.py", "--checkpoint", str(tiny_config(tmp_path)), "--policy", "keydiff",
                  "--budget", "32", "--prompt-tokens", "40", "--block-size", "16", "--steps", "4", "--threads", "1",
                  "--json"], 120)
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(line)
    assert out["world"] == 2 and len(out["step_ms_per_rank"]) == 2
    assert all(0 < s < 1 for s in out["allreduce_share_per_rank"]), out


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
def test_reading_slices_equals_sharding_the_whole(hf_tiny, tmp_path, mode):
    """A rank that reads only its slices of an engine file (tp.read_slices) gets exactly the tensors it keeps when
    it loads the whole checkpoint and shards it (the Hugging Face folder path), quantized scales included; no
    process group is needed to check that (a stand-in group)."""
    import types

    import loading
    import ranks
    import tp
    from convert import ENGINE_FILE, read_hf_dir
    from quantize import quantize_dir
    from safetensors.torch import save_file
    _, src = hf_tiny("llama")
    ckpt = tmp_path / mode
    if mode == "float":
        ckpt.mkdir()
        (ckpt / "config.json").write_text((src / "config.json").read_text())
        save_file({k: v.contiguous() for k, v in read_hf_dir(src).items()}, str(ckpt / ENGINE_FILE))
    else:
        quantize_dir(src, mode, 32 if mode == "int4" else None, out=ckpt)
    for rank in (0, 1):
        mesh = ranks.Mesh(rank, 2, rank, types.SimpleNamespace(group_name="stand-in"))
        sliced = tp.load_model(ckpt, torch.float32, "cpu", mesh).state_dict()
        whole = loading.load_model(ckpt, torch.float32, "cpu", shard=lambda m: tp.apply_tp(m, mesh)).state_dict()
        assert sliced.keys() == whole.keys()
        for k in whole:
            assert torch.equal(sliced[k], whole[k]), k
        assert sliced["layers.0.attention.wqkv.weight"].shape[0] == (4 + 2 * 2) * 16 // 2


RANK_FORKING_RUNS = """
import json, os, sys
sys.path.insert(0, {repo!r})
import generate
for name, (args, port) in json.loads(sys.argv[1]).items():
    pid = os.fork()
    if pid == 0:  # each run a process of its own (its own exit code and output), forked past the imports
        for fd, ext in ((1, "out"), (2, "err")):
            os.dup2(os.open(f"{{name}}.rank{{os.environ['RANK']}}.{{ext}}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.environ["MASTER_PORT"] = port
        sys.exit(generate.main(args))
    with open(f"{{name}}.rank{{os.environ['RANK']}}.rc", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
"""


def two_ranks(runs: dict, tmp_path, timeout: int = 120) -> dict[str, list[subprocess.CompletedProcess]]:
    """generate.py as 2 ranks with torchrun's environment, for each run (name: its arguments) in turn, each rank of
    each run a process of its own (its exit code and output read apart): one process per rank imports generate.py
    once and forks every run's rank process from it, each run on a port of its own. Run name: [rank 0, rank 1]."""
    out = tmp_path / "ranks"
    out.mkdir()
    script = out / "rank.py"
    script.write_text(RANK_FORKING_RUNS.format(repo=str(REPO)))
    todo = json.dumps({str(out / name): (args, str(free_port())) for name, args in runs.items()})
    procs = [subprocess.Popen([sys.executable, str(script), todo], cwd=REPO,
                              env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                      MASTER_ADDR="127.0.0.1", TORCHELASTIC_RUN_ID="test")) for r in (0, 1)]
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
        assert p.returncode == 0
    return {name: [subprocess.CompletedProcess(args, int((out / f"{name}.rank{r}.rc").read_text()),
                                               *((out / f"{name}.rank{r}.{ext}").read_text() for ext in ("out", "err")))
                   for r in (0, 1)] for name, args in runs.items()}


BAD_INPUT = {  # case: generate.py's extra flags, the tiny config's changes, what rank 0's one line says
    "world": (["--tp", "4"], {}, "does not match torchrun's world size 2"),
    "cuda": (["--device", "cuda"], {}, "CUDA is not available"),
    "kv_heads": ([], {"num_key_value_heads": 1}, "to divide the model's KV heads (1)"),
    "speculate": (["--speculate", "2", "--draft-budget", "8"], {}, "--speculate runs on one device"),
}


@pytest.fixture(scope="module")
def bad_input_ranks(tmp_path_factory) -> dict:
    """Every BAD_INPUT case run by generate.py as 2 ranks (two_ranks: one pair of rank processes for all)."""
    tmp = tmp_path_factory.mktemp("bad_input")
    runs = {}
    for case, (extra, over, _) in BAD_INPUT.items():
        (tmp / case).mkdir()
        runs[case] = gen_args(tiny_config(tmp / case, **over), *extra)
    return two_ranks(runs, tmp)


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2_on_rank_0(bad_input_ranks, case):
    """Every rank refuses the same flags: rank 0 prints the one line and exits 2, the other ranks exit 0, so that
    torchrun's report names rank 0 alone (ranks.exit_code)."""
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    r0, r1 = bad_input_ranks[case]
    assert (r0.returncode, r1.returncode) == (2, 0), (r0.stderr, r1.stderr)
    lines = r0.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r0.stderr
    assert BAD_INPUT[case][2] in lines[0]
    assert r1.stdout == r1.stderr == "", "only rank 0 prints"


def test_too_few_gpus(monkeypatch):
    import ranks
    from errors import UserError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError, match="needs one CUDA device per rank; this machine has 1"):
        ranks.check_world(2, None, "cuda")
    ranks.check_world(2, None, "cpu")
    with pytest.raises(UserError, match=r"`tp` must be >= 1 \(ranks\), got 0"):
        ranks.check_world(1, 0, "cpu")


LOST_RANK = """
import os, sys, time, torch
from pathlib import Path
sys.path.insert(0, {repo!r})
import ranks
Path(f"ready{{os.environ['RANK']}}").touch()  # both ranks imported: join together, well within the timeout
while not (Path("ready0").exists() and Path("ready1").exists()):
    time.sleep(0.05)
mesh = ranks.init("cpu", timeout_s=4)
if mesh.rank == 1:
    {lose}  # a rank lost (or stalled) after the group formed
t = time.perf_counter()
try:
    ranks.naming_lost_ranks(lambda a: torch.distributed.all_reduce(torch.ones(4)))(None)
except Exception as e:
    print(f"failed after {{time.perf_counter() - t:.1f}} s: {{type(e).__name__}}: {{e}}")
    os._exit(1)
os._exit(0)
"""


@pytest.mark.parametrize("lose", ["os._exit(3)", "time.sleep(120)"], ids=["lost", "stalled"])
def test_a_lost_rank_does_not_hang(tmp_path, lose):
    """Rank 1 dies (or stalls) after the group formed: rank 0's next collective fails (gloo sees the closed
    connection, or the group's timeout fires) instead of waiting forever, with one line naming rank 1. The ranks
    join only once both have imported torch (the slow, uneven part of a start on a busy machine), so a 4 s group
    timeout leaves the rendezvous seconds of margin while the stalled case waits only those 4 s."""
    script = tmp_path / "lost.py"
    script.write_text(LOST_RANK.format(repo=str(REPO), lose=lose))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=port, TORCHELASTIC_RUN_ID="test")) for r in (0, 1)]
    try:
        out0, _ = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 1 and "failed after" in out0, out0
    assert "EnvironmentFailure: tensor parallel: rank 1 of 2 stopped answering rank 0" in out0, out0


TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}  # a worker's environment, each row changing one variable


@pytest.mark.parametrize("environ,message", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1, WORLD_SIZE=2 in the environment, but this process was not started by "
                                       "torchrun (no TORCHELASTIC_RUN_ID): unset them"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc in the environment, but this process was not started by torchrun"),
    (TORCHRUN | {"WORLD_SIZE": "abc"}, "torchrun's WORLD_SIZE='abc' must be an integer from 1 to 2147483647"),
    (TORCHRUN | {"RANK": "2"}, "torchrun's RANK='2' must be an integer from 0 to 1 (WORLD_SIZE=2)"),
    (TORCHRUN | {"RANK": "-1"}, "torchrun's RANK='-1' must be an integer from 0 to 1"),
    (TORCHRUN | {"RANK": "1_0", "WORLD_SIZE": "20"}, "torchrun's RANK='1_0' must be an integer from 0 to 19"),
    (TORCHRUN | {"RANK": "\u0661"}, "torchrun's RANK='\u0661' must be an integer"),
    (TORCHRUN | {"LOCAL_RANK": "1"}, "torchrun's LOCAL_RANK='1' must be an integer from 0 to 0 (RANK=0)"),
    (TORCHRUN | {"WORLD_SIZE": "0"}, "torchrun's WORLD_SIZE='0' must be an integer from 1"),
    (TORCHRUN | {"WORLD_SIZE": "9" * 30}, "torchrun's WORLD_SIZE='999999999999999999999999999999' must be"),
    (TORCHRUN | {"MASTER_PORT": "70000"}, "torchrun's MASTER_PORT='70000' must be an integer from 1 to 65535"),
    (TORCHRUN | {"MASTER_PORT": "-1"}, "torchrun's MASTER_PORT='-1' must be an integer from 1 to 65535"),
    (TORCHRUN | {"MASTER_PORT": ""}, "torchrun's MASTER_PORT='' must be an integer from 1 to 65535"),
    (TORCHRUN | {"MASTER_PORT": "0"}, "torchrun's MASTER_PORT='0' must be an integer from 1 to 65535"),
    (TORCHRUN | {"MASTER_ADDR": ""}, "torchrun's MASTER_ADDR='' is not a host name or address"),
    (TORCHRUN | {"MASTER_ADDR": "local host"}, "torchrun's MASTER_ADDR='local host' is not a host name or address"),
    (TORCHRUN | {"BUDGETKV_TP_TIMEOUT": "0.001"}, "BUDGETKV_TP_TIMEOUT='0.001' must be a number of seconds >= 1"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"}, "torchrun's environment lacks LOCAL_RANK, "
                                                                   "MASTER_ADDR, MASTER_PORT"),
])
def test_a_partial_or_malformed_torchrun_environment_is_one_line(tmp_path, monkeypatch, capfd, environ, message):
    """Left in a shell, RANK / WORLD_SIZE would make a plain run wait for ranks that never come (its output sent
    to a rank's log): one line on this process's own stderr, exit 2, before any group is joined."""
    import generate
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    code = generate.main(gen_args(tiny_config(tmp_path)))
    out, err = capfd.readouterr()
    assert code == 2 and err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    assert out == ""


def test_a_rank_without_rank_0_says_so_in_one_line(tmp_path):
    """Rank 1 started alone (no rank 0 listens at MASTER_ADDR:MASTER_PORT): once BUDGETKV_TP_TIMEOUT has passed, one
    line on its own stderr (not only in its rank log: no rank 0 prints for it) naming the address, exit 1; torch's
    C++ messages go to a log."""
    p = subprocess.run([sys.executable, "generate.py", *gen_args(tiny_config(tmp_path))], cwd=REPO, timeout=120,
                       capture_output=True, text=True,
                       env=env(**TORCHRUN | dict(RANK="1", LOCAL_RANK="1", MASTER_PORT=str(free_port())),
                               BUDGETKV_TP_TIMEOUT="1", TMPDIR=str(tmp_path)))
    assert p.returncode == 1 and p.stdout == "", p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("error: tensor parallel: rank 1 of 2 could not join the group at MASTER_ADDR=127.0.0.1 "
                           "MASTER_PORT=") and f"{tmp_path}/budgetkv-{os.getuid()}/join1.log" in line, line

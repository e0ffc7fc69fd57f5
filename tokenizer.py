"""Tokenizers for budgetkv: HF tokenizer.json, sentencepiece and Llama 3 tiktoken files.

load_tokenizer(dir) picks the backend from the files present; every backend exposes the same
small interface (encode/decode/eos_ids/chat template) so generate.py never cares which it got.
"""
import base64
import functools
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from errors import UserError
from files import JSON_MAX_BYTES, read_capped, read_json, regular_file


class TokenizerError(UserError):
    """Missing / corrupt tokenizer files; the message is one line meant for the user."""


def with_document(question: str, document: str | None = None) -> str:
    """A question about a document as one prompt text: the document, a blank line, then the question (the order the
    one-shot policies assume: the question is what they read last)."""
    return question if document is None else f"{document.rstrip()}\n\n{question}"


class Tokenizer:
    bos_id: int | None = None
    eos_ids: list[int]
    chat_template: str | None = None
    vocab_size: int
    bos_token: str = ""  # strings handed to the chat template
    eos_token: str = ""

    def encode(self, text: str, add_bos: bool) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    chat_template_file: str = ""  # where the template came from, for error messages

    def render_chat(self, user_message: str) -> str:
        return self.render_messages([{"role": "user", "content": user_message}])

    def render_messages(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text for `messages` ({"role", "content"} dicts), as HF's apply_chat_template."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template")
        text = sum(len(m.get("content") or "") for m in messages)
        try:
            return _render(self.chat_template, TEMPLATE_CHARS + 4 * text, messages=messages,
                           add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                           eos_token=self.eos_token)
        except Exception as e:  # the template is the checkpoint's code: any failure of it is a broken checkpoint
            line = f" line {e.lineno}" if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno else ""
            raise TokenizerError(f"the chat template in {self.chat_template_file or 'the tokenizer files'}{line} "
                                 f"fails: {type(e).__name__}: {_oneline(e)} (--no-chat skips it)") from None

    def prompt_ids(self, question: str, document: str | None = None, chat: bool = True) -> list[int]:
        """A prompt's token ids: with_document(question, document) in the chat template when `chat` and the
        checkpoint has one, else the plain text after the BOS."""
        text = with_document(question, document)
        return self.chat_prompt_ids(text) if chat and self.chat_template is not None else self.encode(text, True)

    def chat_prompt_ids(self, user_message: str) -> list[int]:
        # Templates write the BOS string themselves; HF apply_chat_template does not add another.
        return self.template_ids(self.render_chat(user_message))

    def template_ids(self, text: str) -> list[int]:
        """Token ids of text the chat template wrote (no BOS added: the template writes it)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate written by the template
            raise TokenizerError(f"the chat template in {self.chat_template_file or 'the tokenizer files'} writes "
                                 "text that is not valid Unicode (--no-chat skips it)") from None
        return self.encode(text, add_bos=False)


class _HFTokenizer(Tokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTok
        data = _read_capped(path)
        try:
            self.tok = HFTok.from_str(data.decode("utf-8"))
        except Exception as e:
            raise TokenizerError(f"cannot read {path}: {_oneline(e)}") from None
        self.vocab_size, self.path = self.tok.get_vocab_size(with_added_tokens=True), path

    def encode(self, text, add_bos):
        # add_special_tokens=True runs the file's post_processor, i.e. exactly HF's tokenizer(text).
        # Added/special tokens written in the text are always matched by `tokenizers`.
        try:
            return self.tok.encode(text, add_special_tokens=add_bos).ids
        except BaseException as e:  # a Rust panic (pyo3's PanicException is no Exception): the file's regex failed
            if type(e).__name__ != "PanicException":
                raise
            raise TokenizerError(f"{self.path} cannot tokenize this text: {_oneline(e)} (a pre-tokenizer regex "
                                 "that backtracks without end?)") from None

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_id(self, s):
        return self.tok.token_to_id(s)


class _SPTokenizer(Tokenizer):
    def __init__(self, path: Path):
        import sentencepiece as spm
        data = _read_capped(path)
        try:
            self.sp = spm.SentencePieceProcessor()
            self.sp.LoadFromSerializedProto(data)
        except Exception as e:
            raise TokenizerError(f"cannot read {path}: {_oneline(e)}") from None
        n = self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.bos_token = self.sp.id_to_piece(self.bos_id) if self.bos_id is not None else ""
        self.eos_token = self.sp.id_to_piece(self.sp.eos_id()) if self.sp.eos_id() >= 0 else ""
        # sentencepiece never matches control pieces (<s>, </s>) in text, but chat templates write
        # them as strings, so split them out ourselves (HF's converted tokenizers do the same).
        self.specials = {self.sp.id_to_piece(i): i for i in range(n)
                         if self.sp.is_control(i) or self.sp.is_unknown(i)}
        alts = sorted(self.specials, key=len, reverse=True)
        self.split_re = re.compile("(" + "|".join(map(re.escape, alts)) + ")") if alts else None

    def encode(self, text, add_bos):
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        parts = self.split_re.split(text) if self.split_re else [text]
        for i, part in enumerate(parts):  # odd indices are the captured special tokens
            if i % 2:
                ids.append(self.specials[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids):
        return self.sp.decode(list(ids))  # sentencepiece drops control tokens itself

    def token_id(self, s):
        i = self.sp.piece_to_id(s)
        return None if i == self.sp.unk_id() and s != self.sp.id_to_piece(i) else i


# Llama 3 (Meta "original/tokenizer.model"): tiktoken ranks + this pre-tokenizer regex + 256 specials.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                   "<|python_tag|>"]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(LLAMA3_SPECIALS))]


class _TiktokenTokenizer(Tokenizer):
    def __init__(self, ranks: dict[bytes, int]):
        import tiktoken
        self.n_base = len(ranks)
        self.specials = {s: self.n_base + i for i, s in enumerate(LLAMA3_SPECIALS)}
        self.enc = tiktoken.Encoding("llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=self.specials)
        self.vocab_size = self.n_base + len(self.specials)
        self.bos_id, self.bos_token = self.specials["<|begin_of_text|>"], "<|begin_of_text|>"
        self.eos_token = "<|end_of_text|>"
        # <|eot_id|> ends a chat turn, <|eom_id|> a tool-call message (3.1); both stop generation.
        self.eos_ids = [self.specials[s] for s in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")]

    def encode(self, text, add_bos):
        ids = [self.bos_id] if add_bos else []
        for chunk in _tiktoken_chunks(text):
            ids.extend(self.enc.encode(chunk, allowed_special="all"))
        return ids

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i < self.n_base])

    def token_id(self, s):
        return self.specials.get(s)


def _tiktoken_chunks(s, max_chars=400_000, max_run=25_000):
    # tiktoken's regex backtracking overflows on huge inputs (e.g. 1M spaces), so like Meta's
    # reference we encode 400k-char windows and cut runs of >25k (non-)whitespace chars.
    cuts = set(range(max_chars, len(s), max_chars))
    for m in re.finditer(r"\s{%d,}|\S{%d,}" % (max_run + 1, max_run + 1), s):
        cuts.update(range(m.start() + max_run, m.end(), max_run))
    bounds = [0, *sorted(cuts), len(s)]
    return [s[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _read_tiktoken(path: Path) -> dict[bytes, int] | None:
    """Ranks if the file is tiktoken's `base64 rank` text format, None otherwise (sentencepiece proto)."""
    lines = [line for line in _read_capped(path).splitlines() if line]

    def parse(line):
        tok, rank = line.split()
        return base64.b64decode(tok, validate=True), int(rank)

    try:
        parse(lines[0])  # a binary proto's first line is never "base64 int"
    except (ValueError, IndexError):  # binascii.Error is a ValueError
        return None
    try:
        return dict(map(parse, lines))
    except ValueError:
        raise TokenizerError(f"corrupt tiktoken file {path}: a line is not 'base64 rank'") from None


def check_prompt_ids(ids: list[int], vocab_size: int, which: str, source: str, how: str = "") -> list[int]:
    """A tokenized prompt: not empty (tokenized `how`), every id inside the model's vocabulary (`source` names the
    tokenizer)."""
    if not ids:
        raise UserError(f"{which} is empty once tokenized{how}")
    if max(ids) >= vocab_size:
        raise UserError(f"the tokenizer of {source} gives token id {max(ids)}, outside the model's vocab_size "
                        f"{vocab_size}: tokenizer and weights do not belong together")
    return ids


def load_tokenizer(ckpt_dir) -> Tokenizer:
    d = Path(ckpt_dir)
    tok_cfg = _read_json(d / "tokenizer_config.json")
    if regular_file(d / "tokenizer.json"):
        tok = _HFTokenizer(d / "tokenizer.json")
        cfg_file = d / "tokenizer_config.json"
        tok.bos_token = _tok_str(tok_cfg.get("bos_token"), cfg_file, "bos_token")
        tok.eos_token = _tok_str(tok_cfg.get("eos_token"), cfg_file, "eos_token")
        tok.bos_id = tok.token_id(tok.bos_token) if tok.bos_token else None
    elif regular_file(d / "tokenizer.model"):
        ranks = _read_tiktoken(d / "tokenizer.model")
        tok = _TiktokenTokenizer(ranks) if ranks else _SPTokenizer(d / "tokenizer.model")
    else:
        raise TokenizerError(f"no tokenizer.json or tokenizer.model in {d}")
    eos = list(getattr(tok, "eos_ids", []))
    if tok.eos_token and tok.token_id(tok.eos_token) is not None:
        eos.append(tok.token_id(tok.eos_token))
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(d / name)
        e = cfg.get("eos_token_id")
        eos += [i for i in (e if isinstance(e, list) else [e]) if type(i) is int and i >= 0]
        if tok.bos_id is None and type(cfg.get("bos_token_id")) is int and cfg["bos_token_id"] >= 0:
            tok.bos_id = cfg["bos_token_id"]
    tok.eos_ids = list(dict.fromkeys(eos))  # dedupe, keep order
    tmpl, tok.chat_template_file = tok_cfg.get("chat_template"), str(d / "tokenizer_config.json")
    jinja_file = d / "chat_template.jinja"
    if isinstance(tmpl, list):  # older multi-template format: [{"name": ..., "template": ...}], HF's "default"
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        if named and "default" not in named and not jinja_file.is_file():  # HF refuses it too, never no template
            raise TokenizerError(f"{tok.chat_template_file}: chat_template lists templates named "
                                 f"{', '.join(map(str, named))} but none named default")
        tmpl = named.get("default")
    if tmpl is not None and not isinstance(tmpl, str):
        raise TokenizerError(f"{tok.chat_template_file}: chat_template must be a string or a list of "
                             f"{{name, template}} objects, got {type(tmpl).__name__}")
    if regular_file(jinja_file):
        data = read_capped(jinja_file, 4 * TEMPLATE_CHARS)  # the limit is in characters, of up to 4 bytes each
        if len(data) > 4 * TEMPLATE_CHARS:
            raise TokenizerError(f"the chat template in {jinja_file} is longer than {TEMPLATE_CHARS >> 20} MiB "
                                 "(--no-chat skips it)")
        try:
            tmpl = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"cannot read {jinja_file}: not UTF-8 text ({e.reason})") from None
        tok.chat_template_file = str(jinja_file)
    if tmpl and len(tmpl) > TEMPLATE_CHARS:
        raise TokenizerError(f"the chat template in {tok.chat_template_file} is longer than {TEMPLATE_CHARS >> 20} "
                             "MiB (--no-chat skips it)")
    tok.chat_template = tmpl or None
    return tok


# How text is split before BPE, by llama.cpp's tokenizer.ggml.pre name: the regexes of the models' own
# tokenizer.json files (Llama 3: digits in runs of up to 3; Qwen2: single digits; both case-insensitive contractions).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
GGUF_PRE = {"default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "smollm": "digits", "starcoder": "digits",
            "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
            "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def gguf_pre_tokenizer(pre: str):
    """The pre-tokenizer for a GGUF's tokenizer.ggml.pre; an unknown one is refused rather than guessed, since a
    wrong split gives token ids the model was never trained on."""
    from tokenizers import Regex, pre_tokenizers
    split = GGUF_PRE.get(pre)
    if split is None:
        raise TokenizerError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(sorted(GGUF_PRE))})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "gpt2":  # the GPT-2 regex inside ByteLevel
        return byte_level
    if split == "digits":  # SmolLM2 / StarCoder: every digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def write_gguf_tokenizer(reader, out_dir) -> None:
    """Turn a llama.cpp GGUF's byte-level BPE vocab into tokenizer.json + configs in out_dir."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, processors
    from tokenizers.models import BPE

    from gguf import GGUFValueType as T

    def get(name, default=None):  # strings: bytes(parts[data[i]]); numbers: parts[data[i]][0]
        f = reader.fields.get(name)
        if f is None:
            return default
        vals = [bytes(f.parts[i]).decode() if f.types[-1] == T.STRING else f.parts[i][0].item() for i in f.data]
        return vals if f.types[0] == T.ARRAY else vals[0]

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError(f"unsupported GGUF tokenizer {model!r} (only byte-level BPE 'gpt2' is supported)")
    tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges") or []
    if not tokens:
        raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = HFTok(BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = gguf_pre_tokenizer(get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control (e.g. <|im_end|>): special; 4 = user-defined: matched whole but kept on decode.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    if get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        tok.save(str(out / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for an unwritable path
        raise TokenizerError(f"cannot write {out / 'tokenizer.json'}: {_oneline(e)}") from None
    cfg = {"bos_token": tokens[bos] if bos is not None else None,
           "eos_token": tokens[eos] if eos is not None else None}
    if get("tokenizer.chat_template"):
        cfg["chat_template"] = get("tokenizer.chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    ends = [get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    ends = list(dict.fromkeys(e for e in ends if e is not None))
    gen = {"bos_token_id": bos, "eos_token_id": ends[0] if len(ends) == 1 else ends}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


# ---- helpers -------------------------------------------------------------------------------

def _oneline(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _read_json(path: Path) -> dict:
    if not regular_file(path):
        return {}
    try:
        cfg = read_json(path)
    except ValueError as e:  # includes JSONDecodeError and UnicodeDecodeError
        raise TokenizerError(f"cannot parse {path}: {_oneline(e)}") from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return cfg


def _read_capped(path: Path) -> bytes:
    """A tokenizer file's bytes, refused past JSON_MAX_BYTES (the largest tokenizer.json is under 40 MiB)."""
    data = read_capped(path, JSON_MAX_BYTES)
    if len(data) > JSON_MAX_BYTES:
        raise TokenizerError(f"cannot read {path}: larger than {JSON_MAX_BYTES >> 20} MiB")
    return data


def _tok_str(t, path: Path, key: str) -> str:
    # tokenizer_config.json writes special tokens either as "<s>" or {"content": "<s>", ...}
    s = t.get("content", "") if isinstance(t, dict) else (t or "")
    if not isinstance(s, str):
        raise TokenizerError(f"{path}: {key} must be a string or {{\"content\": string}}, got {t!r}"[:300])
    return s


class _GenerationTag(Extension):
    # Some HF templates mark assistant text with {% generation %}...{% endgeneration %}; render the body.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


TEMPLATE_SECONDS = 10.0  # a chat template renders in milliseconds
TEMPLATE_CHARS = 1 << 20  # a chat template's length; what it may write beyond 4 times its messages' text


class TemplateLimit(Exception):
    """A chat template that would run or grow without bound (_render's limits)."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox and flags (outputs match apply_chat_template byte for byte), with no value past `most`
    characters or items: each value a template reads or a call or filter returns is checked, and so are the
    arguments of every call and filter (a number past `most`: ljust(10**12), center(10**12)) and `*` and `**` (the
    operators that grow a value past the sum of their operands) before they run."""
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, most: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
        self.most = most
        # jinja's own tojson HTML-escapes <>&'; HF templates expect plain JSON.
        self.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        self.filters = {name: self.bounded(f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))

    def sized(self, v):
        if isinstance(v, str | list | tuple | dict) and len(v) > self.most:
            raise TemplateLimit(f"makes a value of {len(v):,} characters or items, more than {self.most:,}")
        return v

    def check_args(self, f, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            if type(a) is int and abs(a) > self.most:
                raise TemplateLimit(f"calls {getattr(f, '__name__', 'a function')} with {a}, more than {self.most:,}")
            self.sized(a)

    def bounded(self, f):
        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def run(*args, **kwargs):
            self.check_args(f, args, kwargs)
            return self.sized(f(*args, **kwargs))
        return run

    def getattr(self, obj, attribute):
        return self.sized(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return self.sized(super().getitem(obj, argument))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja's own signature)
        __self.check_args(__obj, args, kwargs)
        return __self.sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        ints = type(left) is int and type(right) is int
        if operator == "**" and ints and abs(left) > 1 and right * left.bit_length() > 8 * self.most:
            raise TemplateLimit(f"computes {left} ** {right}, a number of more than {self.most:,} bytes")
        if operator == "*" and ints and left.bit_length() + right.bit_length() > 8 * self.most:
            raise TemplateLimit(f"multiplies numbers of more than {self.most:,} bytes")
        for seq, n in ((left, right), (right, left)):
            if operator == "*" and isinstance(seq, str | list | tuple) and type(n) is int and len(seq) * n > self.most:
                raise TemplateLimit(f"repeats a value {n:,} times, more than {self.most:,} characters or items")
        return super().call_binop(context, operator, left, right)


def _render(template: str, most: int, **kw) -> str:
    """The template's text for kw (_Sandbox), bounded: TemplateLimit once it has run TEMPLATE_SECONDS (checked at
    every line of the template's code, in this thread) or written or made a value of more than `most` characters."""
    compiled = _Sandbox(most).from_string(template)
    deadline = time.monotonic() + TEMPLATE_SECONDS

    def in_template(frame, event, arg):  # the template's compiled code (and its macros) is traced line by line
        return each_line if frame.f_code.co_filename == "<template>" else None

    def each_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimit(f"runs longer than {TEMPLATE_SECONDS:g} s")
        return each_line

    before = sys.gettrace()
    sys.settrace(in_template)
    try:
        out, n = [], 0
        for piece in compiled.generate(**kw):
            n += len(piece)
            if n > most:
                raise TemplateLimit(f"writes more than {most:,} characters")
            out.append(piece)
    finally:
        sys.settrace(before)
    return "".join(out)

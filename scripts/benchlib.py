"""What the benchmark scripts share: the prompt document, random prompt ids, comma-separated integer lists, the
bandwidth and matrix-product probes, the settings an output is resumable under, outputs that survive interruption
(--resume), and one configuration run in a fresh process."""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from checkpoint import shape_config
from config import parse_config
from engine import sync
from errors import EnvironmentFailure, UserError
from scripts.outputs import check_settings, checkpoint_identity, read_json, write_atomic


def make_document(tokenizer, n_tokens: int, seed: int = 0) -> tuple[str, list[int]]:
    """A prompt of at most n_tokens (chat-formatted): a fact at the start, filler sentences, a question about the
    fact at the end. Returns (text, ids)."""
    import random
    rng = random.Random(seed)
    subjects = ["The river", "A merchant", "The old library", "Our committee", "The northern valley", "A young engineer",
                "The harbour", "The observatory", "A travelling musician", "The city council"]
    verbs = ["described", "measured", "rebuilt", "visited", "recorded", "painted", "studied", "discussed"]
    objects = ["the bridge near the mill", "a map of the eastern hills", "the winter festival", "an old clock tower",
               "the results of the harvest", "a letter from the coast", "the new railway line", "a garden of herbs"]
    fact = "The secret password for the archive is BLUE-HERON-42."
    filler = []
    while len(tokenizer.encode(" ".join(filler), add_bos=False)) < n_tokens - 60:
        filler += [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} in {1800 + rng.randrange(200)}."
                   for _ in range(50)]
    question = "\n\nQuestion: what is the secret password for the archive, stated at the very start?"

    def encode(t):
        return tokenizer.chat_prompt_ids(t) if tokenizer.chat_template else tokenizer.encode(t, add_bos=True)

    words = (fact + " " + " ".join(filler)).split(" ")
    while True:  # trim filler words until the formatted prompt fits
        text = " ".join(words) + question
        ids = encode(text)
        if len(ids) <= n_tokens:
            return text, ids
        if not words:
            raise UserError(f"--prompt-tokens {n_tokens} is too small: the question alone takes {len(ids)} tokens")
        words = words[: len(words) - max(1, (len(ids) - n_tokens) // 2)]


def random_prompt(config: dict, n: int) -> list[int]:
    """--random-weights: n prompt ids drawn below the vocabulary size (seed 0: every process draws the same)."""
    vocab = parse_config(config).vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} needs integers >= 1, got {text!r}")
    if twice := [v for i, v in enumerate(values) if v in values[:i]]:
        raise UserError(f"{flag} lists {twice[0]} twice")
    return values


def timed_read(x: torch.Tensor, device: str) -> float:
    """Seconds to read x once (a sum: streaming reads, one scalar written)."""
    sync(device)
    t = time.perf_counter()
    x.sum()
    sync(device)
    return time.perf_counter() - t


def read_bandwidth_gb_s(device: str) -> float:
    """Measured streaming-read bandwidth: median time of summing a 512 MiB fp32 tensor."""
    x = torch.ones(2**27, device=device)
    return x.nbytes / statistics.median(timed_read(x, device) for _ in range(5)) / 1e9


def gemm_gflop_s(device: str, dtype: torch.dtype) -> float:
    """Measured dense matrix-product rate: median of 5 products of two 2048 x 2048 matrices in `dtype`."""
    a = torch.randn(2048, 2048, device=device).to(dtype)
    a @ a

    def once() -> float:
        sync(device)
        t = time.perf_counter()
        a @ a
        sync(device)
        return time.perf_counter() - t
    return 2 * 2048**3 / statistics.median(once() for _ in range(5)) / 1e9


# vars(args) that are not settings: the configurations (--policies, --quant's modes, --figure's contexts and
# budgets), where the outputs go, the checkpoint's name (checkpoint_identity instead) and the internal flags
NOT_SETTINGS = {"policies", "quant", "contexts", "budgets", "checkpoint", "json", "out_dir", "resume", "one",
                "one_figure", "one_quant", "plot", "one_batch", "one_batch_prefill"}


def bench_settings(args, ckpt, mode: str) -> dict:
    """What every configuration's measurement depends on besides the configuration itself (recorded beside the
    results; --resume refuses an output with other settings)."""
    # outputs written before these flags stay resumable
    off = {k for k in ("llamacpp", "kv_dtype") if not getattr(args, k, None)}
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k not in NOT_SETTINGS | off} | dict(
        mode=mode, checkpoint=shapes_identity(ckpt) if getattr(args, "random_weights", False) else
        checkpoint_identity(ckpt), threads=torch.get_num_threads(), torch=torch.__version__)


def shapes_identity(name: str) -> dict:
    """--random-weights: what tells one model's shapes from another's (the config, not its path)."""
    import hashlib
    config, shapes = shape_config(name)
    return {"shapes": shapes, "config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]}


def row_ok(x, fields: dict) -> bool:
    kinds = {str: str, int: int, float: (int, float)}
    return isinstance(x, dict) and all(isinstance(x.get(f), kinds[t]) and not isinstance(x.get(f), bool)
                                       for f, t in fields.items())


def previous(path, settings: dict, args, key: str, kind: type, fields: dict, missing_ok: bool = False):
    """--resume: out[key] of the JSON this script left at `path` with these settings (empty when there is none or
    without --resume; missing_ok: also when the output has no `key` yet); each entry a dict with `fields`."""
    old = read_json(path) if args.resume else None
    if old is None:
        return kind()
    check_settings(path, old.get("settings") if isinstance(old, dict) else None, settings)
    if missing_ok and key not in old:
        return kind()
    entries = old.get(key)
    ok = isinstance(entries, kind) and all(row_ok(x, fields) for x in (entries.values() if kind is dict else entries))
    if not ok:
        raise UserError(f"--resume: {path} has no {key} as this script writes them (run without --resume to replace "
                        "it)")
    return kind(measured(path, entries, fields))


def measured(path, entries, fields: dict):
    """The entries (a dict's items, or a list's rows) whose numbers are finite and non-negative, as a measurement
    gives them; each other is left out to be measured again, with one line naming it and the field."""
    for name, x in entries.items() if isinstance(entries, dict) else ((None, x) for x in entries):
        bad = next((f for f, t in fields.items() if t is not str and not 0 <= x[f] < math.inf), None)
        if bad is None:
            yield (name, x) if isinstance(entries, dict) else x
            continue
        row = name if name is not None else ", ".join(f"{f} {x[f]}" for f in fields if fields[f] is not float)
        print(f"--resume: {path}: {row} has {bad} = {x[bad]} (not a finite, non-negative number): measuring it again",
              file=sys.stderr)


def save(path, args, settings: dict, **out) -> None:
    write_atomic(path, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "settings": settings, **out},
                                  indent=2))


def run_one(script: str, argv: list[str], what: str) -> dict:
    """One configuration in a fresh process (`script` with this process's arguments and `argv` added); its JSON line. A failure ends the run
    with one line; the process's whole output goes to a log."""
    r = subprocess.run([sys.executable, script, *sys.argv[1:], *argv], capture_output=True, text=True)
    try:
        return json_result(r, what, "budgetkv-bench")
    except EnvironmentFailure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def json_result(r: subprocess.CompletedProcess, what: str, log_name: str) -> dict:
    """The JSON line a measuring subprocess printed last; or EnvironmentFailure naming its last stderr line and a
    log holding its whole output."""
    lines = r.stdout.strip().splitlines()
    if r.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    log = Path(tempfile.gettempdir()) / f"{log_name}-{os.getpid()}.log"
    log.write_text(r.stdout + r.stderr)
    last = (r.stderr.strip().splitlines() or ["no result"])[-1].removeprefix("error: ")
    raise EnvironmentFailure(f"{what} failed (exit {r.returncode}): {last} (whole output: {log})")



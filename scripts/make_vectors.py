"""Write the porter's test vectors: every registered policy's kept sets, computed by the engine's own cache.py and
policies.py, for a port in another engine to check itself against (scripts/check_port.py, docs/porting.md).

    python scripts/make_vectors.py [OUT]        (default: tests/vectors)

One attention layer's cache is fed post-RoPE queries, keys and values, step by step, under the policy's protocols
(no transformer: the layer's inputs are the vectors' inputs): seeded random ones (shapes gqa, mha), and the embedded
model's layer 0 on a fixed English text (shape smollm2: KV head 0 and its query group, as the engine computes them in
blocks of 16; tests/test_porting.py checks that a whole-model run keeps the same sets at layer 0). Those are read
from the stored inputs/smollm2.safetensors; delete it to take them from the model again. Files:

    manifest.json                 every case: policy, parameters, protocol, budget, shapes, steps, docs section
    inputs/SHAPE.safetensors      q [N, H_q, D], k and v [N, H_kv, D] float32: token i is at position i
    cases/CASE.safetensors        per step s and KV head h (query head for a per-query-head selection):
        kept     uint8 [steps, H_kv, N]  how many slots hold position p after the step (0 or 1; SAGE-KV may store
                                         a token twice)
        scores   float32 [steps, H_kv, N]  the score of each candidate position at the step's eviction (+inf
                                         protected; NaN: not a candidate, or the step scored nothing)
        selected uint8 [steps, H_sel, N]  decode-time sparse attention: 1 on the positions the step attends

Deterministic: running it again writes the same bytes (tests/test_porting.py checks that).
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import engine  # noqa: E402
import runtime  # noqa: E402
import loading  # noqa: E402
import policies  # noqa: E402
from model import ModelArgs  # noqa: E402

SEED = 46
NEW_TOKENS = 4
# name -> (query heads, KV heads, head_dim, prompt length); token i of a shape's inputs is at position i. Parameters:
# PARAMS (small windows for the small budgets), REAL_PARAMS on the real shape (the rest at their defaults).
SHAPES = {"gqa": (4, 2, 8, 32), "mha": (2, 2, 8, 24), "smollm2": (3, 1, 64, 48)}
# The real shape: layer 0 of CHECKPOINT on TEXT's 52 token ids (48 prompt + 4 decode, teacher-forced), its KV head 0
# and query heads 0-2 only (all 3 KV heads would take 200 KB; each KV head keeps its own set).
REAL, CHECKPOINT = "smollm2", "smollm2-135m"
TEXT = ("The lighthouse keeper climbed the narrow stairs every evening at dusk. He lit the great lamp, wound the "
        "clock, and wrote the weather in his log: wind from the west, rain by morning, three ships passing north. "
        "Then he sat by the window and watched")
IDS = [504, 33059, 40061, 30324, 260, 6260, 24224, 897, 9053, 418, 33937, 30, 909, 1150, 260, 1109, 17559, 28, 8376,
       260, 9191, 28, 284, 4150, 260, 3947, 281, 650, 1993, 42, 2251, 429, 260, 5846, 28, 5249, 411, 5738, 28, 1296,
       7761, 7685, 4081, 30, 3875, 384, 2643, 411, 260, 5700, 284, 12635]  # TEXT's ids (no BOS: SmolLM2 adds none)
REAL_FILE = REPO / "tests" / "vectors" / "inputs" / f"{REAL}.safetensors"
REAL_POLICIES = ("keydiff", "keynorm", "h2o", "tova", "snapkv", "snapkv++", "rocketkv")  # their protocol's first run
# Exact duplicates of earlier tokens (same key and value in every head), so that scores tie and the tie rule shows.
DUPLICATES = {p: p - 8 for p in range(12, 40, 3)}

PARAMS = {"keydiff": "window_frac=0.25", "keynorm": "window_frac=0.25", "sink": "n_sink=2", "h2o": "window_frac=0.25",
          "snapkv": "window=4,kernel=3", "snapkv++": "window=4,kernel=3", "rocketkv": "window=4,kernel=3,read=6",
          "exact-topk": "k=6", "kvec": "delta=1,window=4,obs_window=4,long_window=8,kernel=3"}
REAL_PARAMS = {"snapkv": "window=8,kernel=7", "snapkv++": "window=8,kernel=7", "rocketkv": "window=8,kernel=7"}
READS_KV = {"sink": False, "random": False}  # int8 KV changes the inputs of every other rule

DOCS = {"snapkv++": "snapkv-1"}  # docs/policies.md anchors that are not the policy's name


def base_name(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def spec(name: str, shape: str = "gqa") -> str:
    p = (REAL_PARAMS if shape == REAL else PARAMS).get(base_name(name), "")
    return f"{name}:{p}" if p else name


def docs_section(name: str) -> str:
    anchor = "caotebase--fastcaotebase" if ":" in name else DOCS.get(name, name)
    return f"docs/policies.md#{anchor}"


def budget_of(name: str, shape: str) -> int:
    """Small enough that every step evicts (an appending policy's compression drops), as large as the rule needs."""
    if name == "exact-topk":  # holds every token
        return SHAPES[shape][3] + NEW_TOKENS
    if name == "sagekv":
        return 15  # the paper's B = 16: sink 4, top-4 per query head (GQA), ring 4
    if policies.REGISTRY[name].decode == "append":
        return 24 if shape == REAL else 16  # 20 (12) prompt tokens kept + 4 appended
    return 8 if shape == "mha" else 12


def cases() -> list[dict]:
    """The cases of every registered policy: GQA block-wise with blocks of 16, MHA block-wise one token at a time,
    GQA one-shot (the only protocol of a one-shot policy, with an MHA case too), and int8 KV where the rule reads
    keys or values; REAL_POLICIES also on the real shape, with their protocol's first run."""
    out = []
    for name, cls in policies.REGISTRY.items():
        runs = [("gqa", "one-shot", 16), ("mha", "one-shot", 8)] if cls.protocol == "one-shot" else \
            [("gqa", "block", 16), ("mha", "block", 1), ("gqa", "one-shot", 16)]
        int8 = [(*runs[0], "int8")] if READS_KV.get(base_name(name), True) else []
        real = [(REAL, *runs[0][1:])] if name in REAL_POLICIES else []
        for shape, protocol, block, *kv in [*runs, *int8, *real]:
            tag = ("oneshot" if protocol == "one-shot" else f"b{block}") + ("-int8" if kv else "")
            out.append(dict(case=f"{name.replace(':', '-')}-{shape}-{tag}", policy=name, spec=spec(name, shape),
                            protocol=protocol, block_size=block, budget=budget_of(name, shape),
                            kv_dtype=kv[0] if kv else "float32", inputs=shape, docs=docs_section(name)))
    return out


def make_inputs(shape: str) -> dict[str, np.ndarray]:
    if shape == REAL:
        return load_file(str(REAL_FILE)) if REAL_FILE.is_file() else model_inputs()
    Hq, Hkv, D, L = SHAPES[shape]
    N = L + NEW_TOKENS
    g = torch.Generator().manual_seed(SEED + len(shape) * Hq)
    q, k, v = (torch.randn(N, H, D, generator=g) for H in (Hq, Hkv, Hkv))
    for p, src in DUPLICATES.items():
        if p < N:
            k[p], v[p] = k[src], v[src]
    return {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}


def steps_of(case: dict, L: int) -> list[tuple[int, int]]:
    """[start, end) of each step: the prompt in blocks (block-wise) or whole (one-shot), then one token per step."""
    if case["protocol"] == "one-shot":
        prompt = [(0, L)]
    else:
        prompt = [(s, min(s + case["block_size"], L)) for s in range(0, L, case["block_size"])]
    return prompt + [(L + i, L + i + 1) for i in range(NEW_TOKENS)]


# ------------------------------------------------------------------------ the one place that drives the engine


class OneLayer:
    """Just enough of a model for engine.setup and engine.prefill_one_shot: one attention layer whose inputs are
    given post-RoPE q, k, v (the vectors' inputs) instead of being computed from tokens."""

    def __init__(self, Hq, Hkv, D, q, k, v):
        self.args = ModelArgs(vocab_size=1, dim=Hq * D, n_layers=1, n_heads=Hq, n_kv_heads=Hkv, head_dim=D,
                              intermediate_size=1, norm_eps=1e-5, rope_theta=1e4, max_seq_len=1 << 12)
        self.tok_embeddings = torch.nn.Embedding(1, 1)
        self.layers = [torch.nn.Module()]
        self.layers[0].attention = torch.nn.Module()
        self.q, self.k, self.v = q, k, v  # [1, H, N, D]

    @property
    def cache(self):
        return self.layers[0].attention.kv_cache

    def step(self, cache, start: int, end: int) -> None:
        """What model.Attention does around its attention: cache.update, then cache.evict."""
        q, k, v = (t[:, :, start:end] for t in (self.q, self.k, self.v))
        pos = torch.arange(start, end)
        cache.update(q, k, v, pos, pos)
        cache.evict(q, pos, pos)

    def prefill_layer_major(self, idx, input_pos, block_size, scratch, done):
        cache = scratch(0)
        for start in range(0, idx.shape[1], block_size):
            self.step(cache, start, start + block_size)
        done(0, cache)


def run_engine(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The engine's kept sets, scores and selections after every step of one case."""
    Hq, Hkv, D, L = SHAPES[case["inputs"]]
    N = L + NEW_TOKENS
    q, k, v = (torch.from_numpy(inputs[n]).transpose(0, 1)[None].contiguous() for n in ("q", "k", "v"))
    model = OneLayer(Hq, Hkv, D, q, k, v)
    policy = policies.make(case["spec"])
    kv_dtype = {"float32": None, "int8": torch.int8}[case["kv_dtype"]]
    engine.setup(model, policy, case["budget"], L, NEW_TOKENS, case["block_size"], prefill=case["protocol"],
                 kv_dtype=kv_dtype)
    steps = steps_of(case, L)
    kept = np.zeros((len(steps), Hkv, N), np.uint8)
    scores = np.full((len(steps), Hkv, N), np.nan, np.float32)
    selected = np.zeros((len(steps), Hq, N), np.uint8)
    now, sel_heads = [0], [0]  # sel_heads: the selection's heads (H_kv or H_q), 0 while nothing was selected

    def record_scores(view, s):  # the valid slots' scores, by position
        for h in range(Hkv):
            valid = view.pos[0, h] >= 0
            scores[now[0], h, view.pos[0, h][valid].long().numpy()] = s[0, h][valid].numpy()

    if hasattr(policy, "score"):
        score = policy.score
        policy.score = lambda view: (s := score(view), record_scores(view, s))[0]
    if hasattr(policy, "select"):
        select = policy.select

        def recording_select(view):
            idx = select(view)
            if idx is not None:
                sel_heads[0] = idx.shape[1]  # H_kv, or H_q for a selection per query head
                for h in range(idx.shape[1]):
                    p = model.cache.pos[0, h // (idx.shape[1] // Hkv), idx[0, h]]
                    selected[now[0], h, p[p >= 0].long().numpy()] = 1
            return idx
        policy.select = recording_select

    for i, (start, end) in enumerate(steps):
        now[0] = i
        if case["protocol"] == "one-shot" and i == 0:
            engine.prefill_one_shot(model, torch.zeros(L, dtype=torch.long), case["block_size"])
        else:
            model.step(model.cache, start, end)
        for h in range(Hkv):
            pos = model.cache.pos[0, h]
            np.add.at(kept[i, h], pos[pos >= 0].long().numpy(), 1)
    out = {"kept": kept}
    if hasattr(policy, "score"):
        out["scores"] = scores
    if sel_heads[0]:
        out["selected"] = np.ascontiguousarray(selected[:, :sel_heads[0]])
    return out


def run_model(model, case: dict, ids: list[int], after_step, capture: list | None = None) -> None:
    """The whole model on token ids through one case's steps, as the engine runs them (engine.setup, engine.prefill,
    runtime.model_step), the decode tokens teacher-forced (ids[L:], not sampled): after_step(i) after step i.
    capture: gets layer 0's (q, k, v) [1, H, T, D] of each block-wise step."""
    L = len(ids) - NEW_TOKENS
    kv_dtype = {"float32": None, "int8": torch.int8}[case["kv_dtype"]]
    engine.setup(model, policies.make(case["spec"]), case["budget"], L, NEW_TOKENS, case["block_size"],
                 prefill=case["protocol"], kv_dtype=kv_dtype)
    one_shot, done = case["protocol"] == "one-shot", iter(range(len(steps_of(case, L))))
    if capture is not None:
        cache = model.layers[0].attention.kv_cache
        update = cache.update
        cache.update = lambda q, k, v, *a: (capture.append((q, k, v)), update(q, k, v, *a))[1]
    ids = torch.tensor(ids)
    with torch.inference_mode():
        engine.prefill(model, ids[:L], case["block_size"], one_shot=one_shot,
                       on_prefill=None if one_shot else lambda end, L: after_step(next(done)))
        if one_shot:
            after_step(next(done))
        for p in range(L, len(ids)):
            runtime.model_step(model, *engine.decode_inputs(ids[p:p + 1], torch.tensor([p])))
            after_step(next(done))


def model_inputs() -> dict[str, np.ndarray]:
    """The real shape's inputs: layer 0's q, k, v of CHECKPOINT on TEXT, KV head 0 and its query group, computed
    in the real cases' steps (blocks of 16, then one token per step)."""
    from checkpoint import resolve_checkpoint
    from tokenizer import load_tokenizer
    ckpt = resolve_checkpoint(CHECKPOINT)
    model = loading.load_model(ckpt, torch.float32, "cpu")
    Hq, Hkv, D, L = SHAPES[REAL]
    assert load_tokenizer(ckpt).encode(TEXT, add_bos=False) == IDS and len(IDS) == L + NEW_TOKENS
    assert (model.args.head_dim, model.args.n_heads // model.args.n_kv_heads) == (D, Hq // Hkv), model.args
    got = []
    run_model(model, next(c for c in cases() if c["inputs"] == REAL and c["protocol"] == "block"), IDS,
              lambda i: None, got)
    q, k, v = (torch.cat([step[j][0] for step in got], 1).transpose(0, 1) for j in range(3))  # [N, H, D]
    return {n: t[:, :H].contiguous().numpy() for n, t, H in (("q", q, Hq), ("k", k, Hkv), ("v", v, Hkv))}


# ------------------------------------------------------------------------------------------------------ writing


def policy_params(spec_text: str) -> dict:
    p = policies.make(spec_text)
    return {f.name: getattr(p, f.name) for f in policies.parameters(type(p))}


def json_value(x):
    return x if not isinstance(x, float) or np.isfinite(x) else str(x)


def write(out: Path) -> None:
    (out / "inputs").mkdir(parents=True, exist_ok=True)
    (out / "cases").mkdir(parents=True, exist_ok=True)
    shapes = {}
    inputs = {}
    for name, (Hq, Hkv, D, L) in SHAPES.items():
        inputs[name] = make_inputs(name)
        save_file(inputs[name], str(out / "inputs" / f"{name}.safetensors"))
        shapes[name] = dict(file=f"inputs/{name}.safetensors", n_heads=Hq, n_kv_heads=Hkv, head_dim=D, prompt_len=L,
                            new_tokens=NEW_TOKENS, duplicates={str(p): s for p, s in DUPLICATES.items()
                                                               if p < L + NEW_TOKENS and name != REAL})
    shapes[REAL]["source"] = dict(checkpoint=CHECKPOINT, layer=0, kv_heads=[0], query_heads=[0, 1, 2], text=TEXT,
                                  ids=IDS)
    entries = []
    for case in cases():
        result = run_engine(case, inputs[case["inputs"]])
        save_file(result, str(out / "cases" / f"{case['case']}.safetensors"))
        L = SHAPES[case["inputs"]][3]
        params = {k: json_value(v) for k, v in policy_params(case["spec"]).items()}
        entries.append(dict(case, file=f"cases/{case['case']}.safetensors", params=params,
                            steps=[list(s) for s in steps_of(case, L)], outputs=sorted(result)))
    manifest = dict(format=1, seed=SEED, generator="scripts/make_vectors.py", porting="docs/porting.md",
                    shapes=shapes, cases=[])
    # One line per case, so that a changed case is one changed line in review.
    text = json.dumps(manifest, indent=1).replace('"cases": []', '"cases": [\n' + ",\n".join(
        "  " + json.dumps(e) for e in entries) + "\n ]")
    (out / "manifest.json").write_text(text + "\n")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else REPO / "tests" / "vectors"
    torch.set_num_threads(1)
    write(out)
    print(f"wrote {len(cases())} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

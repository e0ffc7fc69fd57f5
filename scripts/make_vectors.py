"""Write the porter's test vectors: every registered policy's kept sets, computed by the engine's own cache.py and
policies.py, for a port in another engine to check itself against (scripts/check_port.py, docs/porting.md).

    python scripts/make_vectors.py [OUT]        (default: tests/vectors)

Attention layers' caches are fed post-RoPE queries, keys and values, step by step, under the policy's protocols (no
transformer: the layers' inputs are the vectors' inputs): seeded random ones (shapes gqa, mha, and gqa-3l, three
layers for K-VEC's coverage term), and the embedded model's layer 0 on a fixed English text (shape smollm2, every
head, as the engine computes them in blocks of 16; tests/test_porting.py checks that a whole-model run keeps the same
sets at layer 0). Those are read from the stored inputs/smollm2.safetensors; delete it to take them from the model
again. Files:

    manifest.json                 every case: policy, parameters, protocol, budget, shapes, steps, docs section
    inputs/SHAPE.safetensors      q [N, L H_q, D], k and v [N, L H_kv, D] float32 (L layers, layer l's heads
                                  from l H): token i is at position i
    cases/CASE.safetensors        per step s and KV head h (query head for a per-query-head selection):
        kept     uint8 [steps, L H_kv, N]  how many slots hold position p after the step (SAGE-KV stores a token
                                           once per query head that picks it)
        scores   float32 [steps, L H_kv, N]  the score of each candidate position at the step's eviction (+inf
                                           protected; NaN: not a candidate, or the step scored nothing)
        selected uint8 [steps, L H_sel, N]  decode-time sparse attention: 1 on the positions the step attends
        mistake.M.kept, mistake.M.selected  what the engine keeps / selects with the known mistake M (MISTAKES),
                                           where that differs: the checker names M when a port's result equals it

Deterministic: running it again writes the same bytes (tests/test_porting.py checks that).
"""
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import cache  # noqa: E402
import engine  # noqa: E402
import runtime  # noqa: E402
import loading  # noqa: E402
import policies  # noqa: E402
from cli import Parser, run_cli  # noqa: E402
from files import check_out_dir  # noqa: E402
from model import ModelArgs  # noqa: E402

NEW_TOKENS = 4
# name -> (query heads, KV heads, head_dim, prompt length, layers, seed); token i of a shape's inputs is at position
# i. Parameters: PARAMS (small windows for the small budgets), REAL_PARAMS on the real shape (the rest at their
# defaults).
SHAPES = {"gqa": (4, 2, 8, 32, 1, 601), "mha": (2, 2, 8, 24, 1, 555), "gqa-3l": (4, 2, 8, 32, 3, 601),
          "smollm2": (9, 3, 64, 32, 1, None)}
# Runs of exact duplicates, (length, starts): the tokens of a run share its first token's key and value in every
# head, and the queries at its positions but the last look away from that key (-AWAY x its direction: their
# attention to the run underflows to exactly 0). Every query then gives a run's tokens the same weight, so a rule
# that reads keys, values or attention scores them equal (accumulated and pooled scores too), and ties meet the cut.
RUNS = {"gqa": (5, (3, 13, 20, 26)), "mha": (6, (1, 11, 20)), "gqa-3l": (5, (3, 13, 20, 26))}
AWAY = 100.0
# In GQA shapes, channel 0 of every decode query is +3 in a group's even query heads and -3 in its odd ones: the
# group's sum is exactly 0 there, where RocketKV's channel sign (>= 0: the max row) is tested.
ZERO_SUM_CHANNEL = 0
# The real shape: layer 0 of CHECKPOINT on TEXT's 36 token ids (32 prompt + 4 decode, teacher-forced), every head.
REAL, CHECKPOINT = "smollm2", "smollm2-135m"
TEXT = ("The lighthouse keeper climbed the narrow stairs every evening at dusk. He lit the great lamp, wound the "
        "clock, and wrote the weather in his log: wind from the west, rain")
IDS = [504, 33059, 40061, 30324, 260, 6260, 24224, 897, 9053, 418, 33937, 30, 909, 1150, 260, 1109, 17559, 28, 8376,
       260, 9191, 28, 284, 4150, 260, 3947, 281, 650, 1993, 42, 2251, 429, 260, 5846, 28, 5249]  # SmolLM2: no BOS
REAL_FILE = REPO / "tests" / "vectors" / "inputs" / f"{REAL}.safetensors"
REAL_POLICIES = ("keydiff", "keynorm", "h2o", "tova", "snapkv", "snapkv++", "rocketkv", "kvec")  # protocol's first run
LAYERED_POLICIES = ("kvec",)  # also on gqa-3l: the only rule that reads other layers

PARAMS = {"keydiff": "window_frac=0.25", "keynorm": "window_frac=0.25", "sink": "n_sink=2", "h2o": "window_frac=0.25",
          "snapkv": "window=4,kernel=3", "snapkv++": "window=4,kernel=3", "rocketkv": "window=4,kernel=3,read=7",
          "exact-topk": "k=6", "kvec": "delta=1,window=4,obs_window=4,long_window=8,kernel=3"}
REAL_PARAMS = {"snapkv": "window=8,kernel=7", "snapkv++": "window=8,kernel=7", "rocketkv": "window=8,kernel=7",
               "kvec": "delta=1,window=8,obs_window=8,long_window=16"}
# RocketKV's budget 20 with read 7 makes r = round(8 x 2 / (20 / 7)) = round(5.6) = 6 (truncated: 5); its default-read
# case, budget 23, reads round(23^2 / 36) = round(14.7) = 15 (floor: 14).
BUDGETS = {("rocketkv", "gqa"): 20}
EXTRA = [dict(case="rocketkv-gqa-oneshot-default-read", policy="rocketkv", spec="rocketkv:window=4,kernel=3",
              protocol="one-shot", block_size=16, budget=23, kv_dtype="float32", inputs="gqa")]
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
    if (name, shape) in BUDGETS:
        return BUDGETS[name, shape]
    if policies.REGISTRY[name].decode == "append":
        return 24 if shape == REAL else 16  # 20 (12) prompt tokens kept + 4 appended
    return 8 if shape == "mha" else 12


def cases() -> list[dict]:
    """The cases of every registered policy: GQA block-wise with blocks of 16, MHA block-wise one token at a time,
    GQA one-shot (the only protocol of a one-shot policy, with an MHA case too), and int8 KV where the rule reads
    keys or values; REAL_POLICIES also on the real shape and LAYERED_POLICIES on gqa-3l, with their protocol's first
    run; then EXTRA."""
    out = []
    for name, cls in policies.REGISTRY.items():
        runs = [("gqa", "one-shot", 16), ("mha", "one-shot", 8)] if cls.protocol == "one-shot" else \
            [("gqa", "block", 16), ("mha", "block", 1), ("gqa", "one-shot", 16)]
        int8 = [(*runs[0], "int8")] if READS_KV.get(base_name(name), True) else []
        real = [(REAL, *runs[0][1:])] if name in REAL_POLICIES else []
        layered = [("gqa-3l", *runs[0][1:])] if name in LAYERED_POLICIES else []
        for shape, protocol, block, *kv in [*runs, *int8, *real, *layered]:
            tag = ("oneshot" if protocol == "one-shot" else f"b{block}") + ("-int8" if kv else "")
            budget = budget_of(name, "gqa" if shape == "gqa-3l" else shape)
            out.append(dict(case=f"{name.replace(':', '-')}-{shape}-{tag}", policy=name, spec=spec(name, shape),
                            protocol=protocol, block_size=block, budget=budget,
                            kv_dtype=kv[0] if kv else "float32", inputs=shape))
    return [dict(c, docs=docs_section(c["policy"])) for c in out + EXTRA]


def make_inputs(shape: str) -> dict[str, np.ndarray]:
    if shape == REAL:
        return load_file(str(REAL_FILE)) if REAL_FILE.is_file() else model_inputs()
    Hq, Hkv, D, L, n_layers, seed = SHAPES[shape]
    N, G = L + NEW_TOKENS, Hq // Hkv
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        q, k, v = (torch.randn(N, H, D, generator=g) for H in (Hq, Hkv, Hkv))
        run, starts = RUNS[shape]
        for s in starts:
            k[s + 1:s + run], v[s + 1:s + run] = k[s], v[s]
            q[s:s + run - 1] = -AWAY * (k[s] / k[s].norm(dim=-1, keepdim=True)).repeat_interleave(G, 0)
        if G > 1:
            q[L:, :, ZERO_SUM_CHANNEL] = torch.tensor([3.0, -3.0]).repeat(Hq // 2)
        layers.append((q, k, v))
    return {n: torch.cat([t[j] for t in layers], 1).numpy() for j, n in enumerate("qkv")}


def duplicates(shape: str) -> dict[str, int]:
    if shape not in RUNS:
        return {}
    run, starts = RUNS[shape]
    return {str(p): s for s in starts for p in range(s + 1, s + run)}


def steps_of(case: dict, L: int) -> list[tuple[int, int]]:
    """[start, end) of each step: the prompt in blocks (block-wise) or whole (one-shot), then one token per step."""
    if case["protocol"] == "one-shot":
        prompt = [(0, L)]
    else:
        prompt = [(s, min(s + case["block_size"], L)) for s in range(0, L, case["block_size"])]
    return prompt + [(L + i, L + i + 1) for i in range(NEW_TOKENS)]


# ------------------------------------------------------------------------ the one place that drives the engine


class Layers:
    """Just enough of a model for engine.setup and engine.prefill_one_shot: attention layers whose inputs are given
    post-RoPE q, k, v (the vectors' inputs) instead of being computed from tokens."""

    def __init__(self, Hq, Hkv, D, qkv: list):
        self.args = ModelArgs(vocab_size=1, dim=Hq * D, n_layers=len(qkv), n_heads=Hq, n_kv_heads=Hkv, head_dim=D,
                              intermediate_size=1, norm_eps=1e-5, rope_theta=1e4, max_seq_len=1 << 12)
        self.tok_embeddings = torch.nn.Embedding(1, 1)
        self.layers = [torch.nn.Module() for _ in qkv]
        for layer, inputs in zip(self.layers, qkv):
            layer.attention = torch.nn.Module()
            layer.inputs = inputs  # q, k, v [1, H, N, D]

    def step(self, i: int, cache, start: int, end: int) -> None:
        """What model.Attention does around its attention: cache.update, then cache.evict."""
        q, k, v = (t[:, :, start:end] for t in self.layers[i].inputs)
        pos = torch.arange(start, end)
        cache.update(q, k, v, pos, pos)
        cache.evict(q, pos, pos)

    def prefill_layer_major(self, idx, input_pos, block_size, scratch, done):
        for i in range(len(self.layers)):
            cache = scratch(i)
            for start in range(0, idx.shape[1], block_size):
                self.step(i, cache, start, start + block_size)
            done(i, cache)


def run_engine(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The engine's kept sets, scores and selections after every step of one case."""
    Hq, Hkv, D, L, n_layers = SHAPES[case["inputs"]][:5]
    N = L + NEW_TOKENS
    qkv = [[torch.from_numpy(inputs[n][:, i * H:(i + 1) * H]).transpose(0, 1)[None].contiguous()
            for n, H in (("q", Hq), ("k", Hkv), ("v", Hkv))] for i in range(n_layers)]
    model = Layers(Hq, Hkv, D, qkv)
    policy = policies.make(case["spec"])
    kv_dtype = {"float32": None, "int8": torch.int8}[case["kv_dtype"]]
    engine.setup(model, policy, case["budget"], L, NEW_TOKENS, case["block_size"], prefill=case["protocol"],
                 kv_dtype=kv_dtype)
    steps = steps_of(case, L)
    kept = np.zeros((len(steps), n_layers * Hkv, N), np.uint8)
    scores = np.full((len(steps), n_layers * Hkv, N), np.nan, np.float32)
    selected = np.zeros((len(steps), n_layers * Hq, N), np.uint8)
    now, sel_heads = [0], [0]  # sel_heads: the selection's heads per layer (H_kv or H_q), 0 while none selected

    def record_scores(view, s):  # the valid slots' scores, by position
        for h in range(Hkv):
            valid = view.pos[0, h] >= 0
            scores[now[0], view.layer * Hkv + h, view.pos[0, h][valid].long().numpy()] = s[0, h][valid].numpy()

    if hasattr(policy, "score"):
        score = policy.score
        policy.score = lambda view: (s := score(view), record_scores(view, s))[0]
    if hasattr(policy, "select"):
        select = policy.select

        def recording_select(view):
            idx = select(view)
            if idx is not None:
                H = sel_heads[0] = idx.shape[1]  # H_kv, or H_q for a selection per query head
                pos = model.layers[view.layer].attention.kv_cache.pos
                for h in range(H):
                    p = pos[0, h // (H // Hkv), idx[0, h]]
                    selected[now[0], view.layer * H + h, p[p >= 0].long().numpy()] = 1
            return idx
        policy.select = recording_select

    for i, (start, end) in enumerate(steps):
        now[0] = i
        if case["protocol"] == "one-shot" and i == 0:
            engine.prefill_one_shot(model, torch.zeros(L, dtype=torch.long), case["block_size"])
        else:
            for j, layer in enumerate(model.layers):
                model.step(j, layer.attention.kv_cache, start, end)
        for j, layer in enumerate(model.layers):
            for h in range(Hkv):
                pos = layer.attention.kv_cache.pos[0, h]
                np.add.at(kept[i, j * Hkv + h], pos[pos >= 0].long().numpy(), 1)
    out = {"kept": kept}
    if hasattr(policy, "score"):
        out["scores"] = scores
    if sel_heads[0]:
        H = sel_heads[0]
        out["selected"] = np.ascontiguousarray(selected.reshape(len(steps), n_layers, Hq, N)[:, :, :H]
                                               .reshape(len(steps), n_layers * H, N))
    return out


# Known mistakes of a port, run by the engine for the checker to name them (check_port.py) and for tests.
TIE_FLIPPED = "tie"  # ties drop the newer position and selections take the higher one


def flipped_drop_lowest(scores, pos, T):
    """cache.drop_lowest with the other tie order: among equal scores the newer position is dropped."""
    by_pos = (-pos).argsort(dim=-1, stable=True)
    rank = scores.gather(-1, by_pos).argsort(dim=-1, stable=True)[..., :T]
    return by_pos.gather(-1, rank).sort(dim=-1).values


def flipped_topk(scores, k):
    """policies.stable_topk with ties to the higher index."""
    n = scores.shape[-1]
    return (n - 1 - STABLE_TOPK(scores.flip(-1), k)).sort(dim=-1).values


STABLE_TOPK, ATTENTION_MASK = policies.stable_topk, cache.attention_mask


def noncausal_mask(slot_pos, query_pos, window):
    """Attention rows over every valid slot, whatever the query's position."""
    return ATTENTION_MASK(slot_pos, torch.where(query_pos >= 0, torch.iinfo(torch.int32).max, query_pos), window)


MISTAKES = {"noncausal": "non-causal attention rows (a query sees the positions <= its own only)",
            "gqa": "query head j grouped with KV head j mod H_kv (KV head h's group: query heads h G .. h G + G - 1)"}


@contextlib.contextmanager
def mistake(name: str):
    """Patch the engine to make a known mistake (TIE_FLIPPED or a MISTAKES key; gqa: see grouped_wrong)."""
    with contextlib.ExitStack() as stack:
        if name == TIE_FLIPPED:
            for module in (cache, policies):
                stack.enter_context(mock.patch.object(module, "drop_lowest", flipped_drop_lowest))
            stack.enter_context(mock.patch.object(policies, "stable_topk", flipped_topk))
        elif name == "noncausal":
            stack.enter_context(mock.patch.object(cache, "attention_mask", noncausal_mask))
        yield


def grouped_wrong(shape: str, inputs: dict) -> dict:
    """The inputs as a port that groups query heads by j mod H_kv sees them: KV head h's group in engine order."""
    Hq, Hkv, _, _, n_layers = SHAPES[shape][:5]
    G = Hq // Hkv
    perm = [layer * Hq + g * Hkv + h for layer in range(n_layers) for h in range(Hkv) for g in range(G)]
    return dict(inputs, q=np.ascontiguousarray(inputs["q"][:, perm]))


def run_mistake(case: dict, inputs: dict, name: str) -> dict[str, np.ndarray]:
    with mistake(name):
        return run_engine(case, grouped_wrong(case["inputs"], inputs) if name == "gqa" else inputs)


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
        cache_0 = model.layers[0].attention.kv_cache
        update = cache_0.update
        cache_0.update = lambda q, k, v, *a: (capture.append((q, k, v)), update(q, k, v, *a))[1]
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
    """The real shape's inputs: layer 0's q, k, v of CHECKPOINT on TEXT, every head, computed in the real cases'
    steps (blocks of 16, then one token per step)."""
    from checkpoint import resolve_checkpoint
    from tokenizer import load_tokenizer
    ckpt = resolve_checkpoint(CHECKPOINT)
    model = loading.load_model(ckpt, torch.float32, "cpu")
    Hq, Hkv, D, L = SHAPES[REAL][:4]
    assert load_tokenizer(ckpt).encode(TEXT, add_bos=False) == IDS and len(IDS) == L + NEW_TOKENS
    assert (model.args.head_dim, model.args.n_heads, model.args.n_kv_heads) == (D, Hq, Hkv), model.args
    got = []
    run_model(model, next(c for c in cases() if c["inputs"] == REAL and c["protocol"] == "block"), IDS,
              lambda i: None, got)
    q, k, v = (torch.cat([step[j][0] for step in got], 1).transpose(0, 1) for j in range(3))  # [N, H, D]
    return {"q": q.contiguous().numpy(), "k": k.contiguous().numpy(), "v": v.contiguous().numpy()}


# ------------------------------------------------------------------------------------------------------ writing


def policy_params(spec_text: str) -> dict:
    p = policies.make(spec_text)
    return {f.name: getattr(p, f.name) for f in policies.parameters(type(p))}


def json_value(x):
    return x if not isinstance(x, float) or np.isfinite(x) else str(x)


def differs(a: dict, b: dict, name: str) -> bool:
    return name in a and not np.array_equal(a[name], b[name])


def write(out: Path) -> None:
    (out / "inputs").mkdir(parents=True, exist_ok=True)
    (out / "cases").mkdir(parents=True, exist_ok=True)
    shapes = {}
    inputs = {}
    for name, (Hq, Hkv, D, L, n_layers, seed) in SHAPES.items():
        inputs[name] = make_inputs(name)
        save_file(inputs[name], str(out / "inputs" / f"{name}.safetensors"))
        shapes[name] = dict(file=f"inputs/{name}.safetensors", n_layers=n_layers, n_heads=Hq, n_kv_heads=Hkv,
                            head_dim=D, prompt_len=L, new_tokens=NEW_TOKENS, seed=seed, duplicates=duplicates(name))
        if name in RUNS:
            run, starts = RUNS[name]
            shapes[name]["looking_away"] = [p for s in starts for p in range(s, s + run - 1)]
            if Hq > Hkv:
                shapes[name]["zero_sum_channel"] = ZERO_SUM_CHANNEL
    shapes[REAL]["source"] = dict(checkpoint=CHECKPOINT, layer=0, text=TEXT, ids=IDS)
    entries = []
    for case in cases():
        result = run_engine(case, inputs[case["inputs"]])
        tie = any(differs(result, run_mistake(case, inputs[case["inputs"]], TIE_FLIPPED), n)
                  for n in ("kept", "selected"))
        known = {}
        for m in MISTAKES:
            if m == "gqa" and SHAPES[case["inputs"]][0] == SHAPES[case["inputs"]][1]:
                continue  # one query head per KV head: no grouping to get wrong
            wrong = run_mistake(case, inputs[case["inputs"]], m)
            known.update({f"mistake.{m}.{n}": wrong[n] for n in ("kept", "selected") if differs(result, wrong, n)})
        save_file({**result, **known}, str(out / "cases" / f"{case['case']}.safetensors"))
        L = SHAPES[case["inputs"]][3]
        params = {k: json_value(v) for k, v in policy_params(case["spec"]).items()}
        entries.append(dict(case, file=f"cases/{case['case']}.safetensors", params=params,
                            steps=[list(s) for s in steps_of(case, L)], outputs=sorted(result), tie=tie,
                            mistakes=sorted({k.split(".")[1] for k in known})))
    manifest = dict(format=2, generator="scripts/make_vectors.py", porting="docs/porting.md",
                    mistakes=MISTAKES, shapes=shapes, cases=[])
    # One line per case, so that a changed case is one changed line in review.
    text = json.dumps(manifest, indent=1).replace('"cases": []', '"cases": [\n' + ",\n".join(
        "  " + json.dumps(e) for e in entries) + "\n ]")
    (out / "manifest.json").write_text(text + "\n")


def parser() -> Parser:
    ap = Parser(description=__doc__)
    ap.add_argument("out", nargs="?", type=Path, default=REPO / "tests" / "vectors",
                    help="the folder the vectors are written to (default: tests/vectors)")
    return ap


def run(a) -> int:
    check_out_dir(a.out, "OUT")
    torch.set_num_threads(1)
    write(a.out)
    print(f"wrote {len(cases())} cases to {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Self-speculative decoding: the model drafts K tokens reading a small budgeted KV cache, then verifies them in one
block over its full cache, so the output is what the full cache alone gives (greedy: the same tokens; sampling: the
same distribution) while most steps read the small cache.

Two caches persist across rounds: the target's (`full`: slot == position) and the draft's, managed by any policy at
its budget, attached to `draft_model(model)` (a shallow copy whose attention modules share every parameter but hold
their own `kv_cache`) or to a separate draft checkpoint of the same vocabulary. The prompt goes into both first
(prefill: a one-shot draft over the target's weights shares one dense prefill with it). A round, with the last
sampled token t at position p (written to neither cache yet, as in engine.generate):

1. K draft decode steps on the draft cache: t at p, d1 at p+1, ..., d_{K-1} at p+K-1 give d1..dK (sampling: each
   from its distribution q_i, top-k / top-p applied).
2. One verification block [t, d1, ..., dK] at positions p..p+K over the target cache, logits at every position.
3. accept(): the longest prefix of drafts the target agrees with, plus one token of the target's own. Greedy: d_i
   is kept while it is the target's argmax; the next token is the target's argmax after the kept prefix. Sampling
   (the standard rule, Leviathan et al. / Chen et al. 2023): d_i is kept with probability min(1, p_i(d_i) /
   q_i(d_i)); at the first rejection the next token is drawn from norm(max(0, p_i - q_i)); when all K are kept,
   the bonus token is drawn from p_K. The output distribution is then exactly p's (top-k / top-p applied to both).
4. rollback(): in both caches every slot whose position is past the last kept token becomes empty (pos -1), as
   tensor ops; the next tokens fill those slots. When all K drafts were kept, dK is fed to the draft (one more
   draft step, its logits unused) so that the draft cache holds every kept token.

The draft cache rule: a rejected draft token may already have made the draft policy evict a token; that token stays
evicted (rollback empties only the rejected tokens' slots), and per-layer policy state keeps what rejected tokens
added to it (H2O's sums, RocketKV's page bounds; SnapKV's query ring forgets their positions). This changes what
the draft keeps, hence the acceptance rate, never the output: the target decides every token. The draft never holds
more than its budget: a rollback only empties slots.

The target must not evict: a K+1-token block evicts once, after all K+1 tokens attended, where K+1 decode steps
evict after each token and change what the next one sees, so an evicting target's output would depend on K and on
the acceptances; Exact-TopK selects its top-k only in single-token decode steps (a block attends densely). Both are
refused (check_target); the target is `full`.
"""
import copy
import re
import time
from collections import namedtuple

import torch
import torch.nn as nn

import engine
import policies
import loading
import runtime
from cache import check_set_up, is_scorer, kv_bytes, run_caches
from checkpoint import resolve_checkpoint, shape_config
from errors import UserError
from sampling import GREEDY, Sampling, check_finite, race

MAX_K = 16  # drafts per round: each costs a draft step, and the chance that a round keeps them all falls
# geometrically with K
DEFAULT_DRAFT_BUDGET = 256  # the draft cache's slots (MagicDec's StreamingLLM drafts hold a few hundred tokens)

Steps = namedtuple("Steps", "prefill draft_prefill draft verify")


def draft_step(model, idx, input_pos):  # dynamo caches a compiled graph per code object: one function per step
    return model(idx, input_pos)


def verify_step(model, idx, input_pos):
    return model(idx, input_pos, every_position=True)[0]


def draft_prefill_step(model, idx, input_pos):
    return model(idx, input_pos)


EAGER = Steps(runtime.prefill_step, draft_prefill_step, draft_step, verify_step)


def draft_model(model) -> nn.Module:
    """A shallow copy of `model` sharing every parameter and buffer, whose attention modules hold their own
    `kv_cache` (None until engine.setup attaches one): the same weights over a second cache. Make it after any
    in-place swap of the model's modules (quantize.quantize_model): the copy keeps the modules it saw."""
    def shallow(m):
        c = copy.copy(m)
        c._modules = dict(m._modules)
        return c
    draft = shallow(model)
    draft.layers = nn.ModuleList()
    for layer in model.layers:
        copied = shallow(layer)
        copied.attention = shallow(layer.attention)
        copied.attention.kv_cache = None
        draft.layers.append(copied)
    return draft


def check_k(k: int, name: str = "k") -> None:
    """k, the drafted tokens per round, in 1..MAX_K (`name`: the caller's word for it, a command line's flag)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise UserError(f"{name} must be between 1 and {MAX_K} drafted tokens per round, got {k!r}")


def check_target(policy) -> None:
    """The target cache must give each token what single decode steps give it: `full` only (module docstring)."""
    if policy is None:
        return
    if is_scorer(policy):
        raise UserError(f"speculation verifies K+1 tokens as one block, and policy={policy.name} would evict once "
                        "per block instead of once per token: its output would change with K; the target must be "
                        "full (policy=full), the draft takes the budget (`draft_policy`)")
    raise UserError(f"speculation verifies K+1 tokens as one block, which attends densely: policy={policy.name} "
                    "selects its slots only in single-token decode steps, so the block would not reproduce it; "
                    "the target must be full (policy=full)")


def check_draft(policy, budget: int, target_capacity: int, same_weights: bool) -> None:
    """A draft over the target's own weights must read less than the target: an evicting policy at a budget below
    the target's capacity. A separate draft checkpoint may keep everything (full, Exact-TopK)."""
    name = policy.name if policy is not None else "full"
    if not same_weights:
        return
    if not is_scorer(policy):
        raise UserError(f"draft_policy={name} keeps every token: over the target's own weights it would read the "
                        "same cache as the target; pick an evicting policy (e.g. sink, snapkv, keydiff) or give "
                        "`draft_checkpoint`")
    if budget >= target_capacity:
        raise UserError(f"draft_budget={budget} must be below the target's capacity ({target_capacity} slots: "
                        "prompt + new tokens + K), else the draft reads as much as the target")


def draft_policy(target_policy, spec: str | None, draft_checkpoint: str | None, prefill: str | None):
    """(spec, policy, prefill protocol) of the draft cache: `spec` (default sink, full with a draft checkpoint)
    with `prefill` (None: the policy's default); the target's policy must be full (check_target)."""
    check_target(target_policy)
    spec = spec or ("full" if draft_checkpoint else "sink")
    policy = policies.make(spec)
    return spec, policy, engine.prefill_protocol(policy, prefill)


def load_draft(target, checkpoint: str | None, dtype: torch.dtype, device: str, random_seed: int | None = None):
    """The draft model: the target's own weights over a second cache (checkpoint None: draft_model), or
    `checkpoint` (a short name, a directory, a .gguf) loaded, or with random_seed its shapes with random weights."""
    if checkpoint is None:
        return draft_model(target)
    if random_seed is not None:
        config, shapes = shape_config(checkpoint)
        return loading.random_model(config, dtype, device, random_seed, label=f"the draft ({shapes})")
    return loading.load_model(resolve_checkpoint(checkpoint, "draft_checkpoint"), dtype, device)


def setup(target, draft, draft_policy, draft_budget: int | None, prompt_len: int, max_new_tokens: int,
          block_size: int, k: int, *, target_budget: int | None = None, draft_prefill: str | None = None,
          kv_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """Caches for a speculative run: the target's `full` cache (target_budget, default prompt + new tokens + k:
    a round writes up to k tokens past the last one kept) and the draft's, policy `draft_policy` at
    `draft_budget` (default: for an evicting policy DEFAULT_DRAFT_BUDGET, at most half the target's; for one that
    keeps every token, a separate draft checkpoint's, the target's), prefilled with the policy's protocol
    (draft_prefill: --prefill). Returns (target slots, draft slots)."""
    check_k(k)
    if {id(layer.attention) for layer in draft.layers} & {id(layer.attention) for layer in target.layers}:
        raise UserError("draft= shares layers with the target (the target itself, or a shallow copy): its cache would "
                        "replace the target's full one; pass speculative.draft_model(target) or a draft checkpoint")
    if draft.args.vocab_size != target.args.vocab_size:
        raise UserError(f"the draft checkpoint's vocabulary ({draft.args.vocab_size} tokens) is not the target's "
                        f"({target.args.vocab_size}): a draft must share the target's tokenizer")
    n = max_new_tokens + k
    capacity = target_budget or prompt_len + n
    default = "" if draft_budget is not None else \
        f" (draft_budget={min(DEFAULT_DRAFT_BUDGET, capacity // 2)} is the default, half the target's {capacity} " \
        "slots: give `draft_budget`, or a longer prompt)"  # a default the user never gave is named as one
    if draft_budget is None:
        draft_budget = min(DEFAULT_DRAFT_BUDGET, capacity // 2) if is_scorer(draft_policy) else capacity
    check_draft(draft_policy, draft_budget, capacity, draft.tok_embeddings is target.tok_embeddings)
    slots = engine.setup(target, None, capacity, prompt_len, n, block_size, kv_dtype=kv_dtype)
    protocol = engine.prefill_protocol(draft_policy, draft_prefill)
    try:
        draft_slots = engine.setup(draft, draft_policy, draft_budget, prompt_len, n, block_size, prefill=protocol,
                                   kv_dtype=kv_dtype)
    except UserError as e:  # the draft's policy and budget are the parameters draft_policy and draft_budget
        line = re.sub(r"(?<![\w-])(`?)(budget|policy)\b", r"\1draft_\2", str(e))
        raise type(e)(line + (default if "draft_budget" in line else "")) from None
    return slots, draft_slots


class Speculation(engine.Generation):
    """A speculative run through Generation's lifecycle: made with the target's settings (its policy full or None,
    one prompt; budget: the target's slots, default prompt + new tokens + k) and the draft's (draft_policy,
    draft_budget, draft_prefill: see setup()), then setup(target, draft) (both caches), compile() (the draft step
    and the K+1 verification block, torch.compile's never AOT; the prefill steps when compiled), generate()."""
    fns, aot = ((runtime.prefill_step, draft_prefill_step), (draft_step, verify_step)), False

    def __init__(self, args, policy, prompt_lens: list[int], *, draft_policy, k: int, draft_budget: int | None = None,
                 draft_prefill: str | None = None, budget: int | None = None, **kw):
        check_k(k)
        check_target(policy)
        draft_policy = policies.resolve(draft_policy)  # a spec string or a policy object, as `policy`
        if len(prompt_lens) != 1:
            raise UserError(f"speculation generates one sequence, not a batch of {len(prompt_lens)}")
        super().__init__(args, None, prompt_lens, budget=budget, prefill="block", **kw)  # the target's
        self.target_budget, self.draft_policy, self.k, self.draft_budget = budget, draft_policy, k, draft_budget
        self.draft_prefill, self.draft, self.draft_slots = engine.prefill_protocol(draft_policy, draft_prefill), None, 0

    def setup(self, target, draft) -> tuple[int, int]:
        """Both caches (module setup()); returns (target slots, draft slots)."""
        self.draft = draft
        self.slots, self.draft_slots = setup(target, draft, self.draft_policy, self.draft_budget, self.lens[0],
                                             self.max_new_tokens, self.block_size, self.k,
                                             target_budget=self.target_budget, draft_prefill=self.draft_prefill,
                                             kv_dtype=self.kv_dtype)
        self.set_up = (run_caches(self, target), list(self.lens))  # both models' caches: what generate() checks
        return self.slots, self.draft_slots

    @property
    def one_shot(self) -> bool:
        return self.draft_prefill == "one-shot"

    @torch.inference_mode()
    def warm_up(self, target, first_id: int) -> None:
        """Compile (or load) every step before anything is timed, with inputs made as generate makes them; twice
        each, since CUDA graph trees record a graph on its second call. Leaves the caches dirty: generate resets."""
        check_set_up(self, target)
        steps, first, k, device = Steps(*self.steps), torch.tensor([first_id], device=self.device), self.k, self.device
        steps.prefill(target, *engine.block_inputs(first, 0, self.block_size))
        if not self.one_shot:
            steps.draft_prefill(self.draft, *engine.block_inputs(first, 0, self.block_size))
        for _ in range(2):
            steps.draft(self.draft, torch.tensor([[first_id]], device=device), torch.tensor([1], device=device))
            steps.verify(target, torch.full((1, k + 1), first_id, device=device), torch.arange(1, k + 2, device=device))
        engine.sync(device)

    def generate(self, target, prompts: list[list[int]], **kw) -> tuple[list, dict]:
        """generate() of the one prompt with this run's steps and sampling (kw: eos_ids, on_token, on_prefill,
        on_round); returns ([its ids], stats): generate()'s, the compile's record, the draft's tokens read per
        step, the target's prefill chunk (engine.dense_chunk), both caches' bytes and the bandwidth model's best
        case (every draft kept)."""
        check_set_up(self, target, prompts)
        draft, steps, (prompt,) = self.draft, Steps(*self.steps), prompts
        out, stats = generate(target, draft, prompt, self.max_new_tokens, k=self.k, block_size=self.block_size,
                              steps=steps, device=self.device, draft_one_shot=self.one_shot, sampling=self.sampling,
                              **kw)
        shared = self.one_shot and draft.tok_embeddings is target.tok_embeddings  # one prefill for both (prefill)
        chunk = not shared and engine.dense_chunk(target, self.block_size, steps.prefill) or self.block_size
        stats.update(draft_slots_read_per_step=draft.layers[0].attention.kv_cache.read_tokens(),
                     block_size=self.block_size, prefill_chunk=chunk, **runtime.THREADS.report(),
                     compiled=steps.draft is not draft_step, compiled_prefill=self.compiled_prefill,
                     compile_mode=self.compile_mode, compile_s=round(self.compile_s, 2),
                     compile_cache=self.compile_cache, kv_cache_bytes=kv_bytes(target) + kv_bytes(draft),
                     best_case_speedup=predicted_speedup(target, draft, self.k))
        return [out], stats


def normalized(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(-1, keepdim=True)


def draft_tokens(draft, step, token: torch.Tensor, p: int, k: int, sampling: Sampling):
    """K draft decode steps from `token` [1, 1] at position p: the drafts [k] and, when sampling, the distribution
    each was drawn from [k, V] (None when greedy)."""
    drafts, dists = [], []
    for i in range(k):
        logits = step(draft, token, torch.tensor([p + i], device=token.device))
        if sampling.greedy:
            t = logits.argmax(-1)
        else:
            q = normalized(sampling.probabilities(logits))
            t = race(q)
            dists.append(q[0])
        drafts.append(t)
        token = t.view(1, 1)
    return torch.cat(drafts), (torch.stack(dists) if dists else None)


def accept(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampling: Sampling
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, token): how many of the drafts [K] the target keeps, and its own next token, from the verification
    logits [K+1, V] (row i predicts the token after the block's i-th) and the draft distributions q [K, V] (None:
    greedy). Greedy: the drafts that equal the target's argmax, in a row, then its argmax. Sampling: d_i kept with
    probability min(1, p_i(d_i) / q_i(d_i)); after the first rejection the token is drawn from norm(max(0, p_n -
    q_n)) (p_n where that is all zero, which only rounding allows), after K kept ones from p_K. Device tensors, no
    host sync; token is -1 when the logits are not all finite."""
    K = drafts.numel()
    finite = torch.isfinite(logits).all()
    if q is None:
        best = logits.argmax(-1)
        n = (drafts == best[:K]).long().cumprod(0).sum()
        return n, torch.where(finite, best[n], -1)
    p = normalized(sampling.probabilities(logits))
    pd, qd = (d.gather(-1, drafts[:, None])[:, 0] for d in (p[:K], q))
    kept = torch.rand(K, device=logits.device) * qd < pd  # P(u < p / q) = min(1, p / q)
    n = kept.long().cumprod(0).sum()
    residual = torch.cat([(p[:K] - q).clamp_min(0), p[K:]])[n]
    residual = torch.where(residual.sum() > 0, residual, p[n])
    return n, torch.where(finite, race(residual), -1)


def rollback(model, last: int) -> None:
    """Forget every token past position `last` in each layer's cache (KVCache.forget_from)."""
    for layer in model.layers:
        layer.attention.kv_cache.forget_from(last + 1)


@torch.inference_mode()
def generate(target, draft, prompt_ids: list[int], max_new_tokens: int, *, k: int, block_size: int,
             steps: Steps = EAGER, eos_ids=(), sampling: Sampling = GREEDY, on_token=None, device="cpu",
             draft_one_shot=False, on_prefill=None, on_round=None) -> tuple[list, dict]:
    """Prefill both caches (the target block-wise, the draft one-shot when draft_one_shot, as setup planned it),
    then speculative rounds of k drafts (decode) until max_new_tokens or EOS; returns (generated ids, stats): the
    ids engine.generate gives with the target cache (greedy: the same tokens; sampling: the same distribution).
    on_token, on_round: see decode."""
    for m in (target, draft):
        for layer in m.layers:
            layer.attention.kv_cache.reset()
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    L = len(prompt_ids)
    engine.check_capacity(target, L, max_new_tokens + k, False)
    engine.check_capacity(draft, L, max_new_tokens + k, draft_one_shot)
    mem = engine.PeakMemory(device)
    stats = {"prompt_tokens": L, "memory_measure": mem.measure, "startup_peak_bytes": mem.peak()}

    mem.reset()
    engine.sync(device)
    t0 = time.perf_counter()
    logits = prefill(target, draft, prompt, block_size, steps, draft_one_shot, on_prefill)
    tok = int(sampling.tokens(logits).item())
    check_finite(tok, 0)
    t1 = time.perf_counter()
    stats.update(ttft_s=t1 - t0, prefill_tok_s=L / (t1 - t0), prefill_peak_bytes=mem.peak())

    out = [tok]
    if on_token:
        on_token(out)
    mem.reset()
    t2 = time.perf_counter()
    kept, draft_steps = decode(target, draft, out, L, max_new_tokens, k=k, steps=steps, eos_ids=eos_ids,
                               sampling=sampling, on_token=on_token,
                               on_round=on_round)
    engine.sync(device)
    t3 = time.perf_counter()
    n_decode = len(out) - 1
    rounds = len(kept)
    stats.update(decode_tokens=n_decode, decode_s=t3 - t2, decode_tok_s=n_decode / (t3 - t2) if n_decode else 0.0,
                 decode_peak_bytes=mem.peak(), generated_tokens=len(out), speculate_k=k, rounds=rounds,
                 draft_steps=draft_steps, accepted_per_round=sum(kept) / rounds if rounds else 0.0,
                 acceptance_rate=sum(kept) / (k * rounds) if rounds else 0.0,
                 all_accepted_rounds=sum(n == k for n in kept),
                 predicted_speedup=predicted_speedup(target, draft, k, kept))
    return out, stats


def prefill(target, draft, prompt: torch.Tensor, block_size: int, steps: Steps, draft_one_shot: bool,
            on_prefill=None) -> torch.Tensor:
    """The prompt into both caches; returns the target's last-position logits. A one-shot draft over the target's
    own weights shares one dense prefill with it: each layer's whole-prompt scratch (slot = position) is what the
    target's full cache holds, copied there before the draft's compression. Otherwise the target is prefilled
    block-wise, then the draft with its protocol."""
    if draft_one_shot and draft.tok_embeddings is target.tok_embeddings:
        def to_target(i, scratch):
            c = target.layers[i].attention.kv_cache
            dst = [c.pos, *c.slot_buffers()]
            for d, src in zip(dst, [scratch.pos, *scratch.slot_buffers()][:len(dst)]):  # K, V (+ scales)
                d[:, :, :prompt.numel()] = src[:, :, :prompt.numel()]
        return engine.prefill_one_shot(draft, prompt, block_size, on_prefill=on_prefill, on_layer=to_target)
    logits = engine.prefill(target, prompt, block_size, steps.prefill, on_prefill=on_prefill)
    engine.prefill(draft, prompt, block_size, steps.draft_prefill, draft_one_shot)
    return logits


@torch.inference_mode()
def decode(target, draft, out: list[int], p: int, max_new_tokens: int, *, k: int, steps: Steps = EAGER, eos_ids=(),
           sampling: Sampling = GREEDY, on_token=None, on_round=None) -> tuple[list[int], int]:
    """Speculative rounds from out[-1], the last sampled token, at position p (written to neither cache), appending
    to `out` until it holds max_new_tokens or ends with an EOS; returns (drafts kept in each round, draft steps
    run). on_token(out) after each new token; on_round(out, n_kept) after each round's rollback."""
    device = target.tok_embeddings.weight.device
    kept, draft_steps, tok = [], 0, out[-1]
    while len(out) < max_new_tokens and tok not in eos_ids:
        token = torch.tensor([[tok]], device=device)
        drafts, q = draft_tokens(draft, steps.draft, token, p, k, sampling)
        logits = steps.verify(target, torch.cat([token[0], drafts]).view(1, k + 1),
                              torch.arange(p, p + k + 1, device=device))
        n, nxt = accept(drafts, q, logits, sampling)
        *ids, n, nxt = torch.cat([drafts, n.view(1), nxt.view(1)]).tolist()  # the round's one host sync
        check_finite(nxt, len(out))
        draft_steps += k
        if n == k:  # nothing to roll back, but the draft has not seen dK yet
            steps.draft(draft, drafts[-1:].view(1, 1), torch.tensor([p + k], device=device))
            draft_steps += 1
        else:
            rollback(target, p + n)
            rollback(draft, p + n)
        kept.append(n)
        for t in ids[:n] + [nxt]:
            if len(out) >= max_new_tokens or tok in eos_ids:
                break
            out.append(t)
            tok = t
            if on_token:
                on_token(out)
        if on_round:
            on_round(out, n)
        p += n + 1
    return kept, draft_steps


def round_bytes(target, draft, k: int, accepted: float, all_kept: float) -> tuple[float, float]:
    """The bandwidth model of one round: (bytes read, tokens made). A round reads k draft steps (one more when all
    k are kept: the draft catches up) and one verification, which reads what a target decode step reads (weights
    and KV once; its k+1 queries share them); it makes accepted + 1 tokens."""
    target_b, draft_b = sum(engine.decode_bytes_per_step(target)), sum(engine.decode_bytes_per_step(draft))
    return (k + all_kept) * draft_b + target_b, accepted + 1


def predicted_speedup(target, draft, k: int, kept: list[int] | None = None) -> float:
    """Decode speedup over the target alone that the bandwidth model predicts: bytes per token of a plain target
    step over bytes per token of a round. kept: the drafts kept in each round (measured); None: every draft kept,
    the best case, below 1 where speculation cannot win (a short context: the draft saves too little KV)."""
    if kept is None:
        accepted, all_kept = float(k), 1.0
    elif not kept:
        return 0.0
    else:
        accepted, all_kept = sum(kept) / len(kept), sum(n == k for n in kept) / len(kept)
    read, made = round_bytes(target, draft, k, accepted, all_kept)
    return sum(engine.decode_bytes_per_step(target)) * made / read

"""The engine: a fixed-budget run of a model (block-wise or one-shot prefill, the decode loop, timing and memory) and
`Generation`, the lifecycle every entry point drives. generate.py is its command line; loading.py builds models."""
import contextlib
import dataclasses
import time

import runtime
import torch

import kernels
import policies
import progress
from cache import (check_kv_dtype, check_set_up, compress_into, eager_blocks, is_scorer, kv_bytes, row_cache,
                   run_caches, scratch_cache, setup_caches)
from checkpoint import resolve_checkpoint
from errors import UserError, check_int, check_text
from loading import check_fits, kv_cache_estimate, load_model
from model import ModelArgs
from policies import Run
from runtime import model_step, prefill_step
from sampling import GREEDY, Sampling, StopStrings, check_finite, first_tokens, stop_reason
from tokenizer import check_prompt_ids, load_tokenizer


# ----------------------------------------------------------------------------------------------------- generation

def block_inputs(prompt: torch.Tensor, start: int, block_size: int):
    """One prefill block, padded to block_size so every block has the same shape (no recompiles)."""
    chunk = prompt[start:start + block_size]
    n = chunk.numel()
    idx = torch.zeros(1, block_size, dtype=torch.long, device=prompt.device)
    idx[0, :n] = chunk
    pos = torch.arange(start, start + block_size, device=prompt.device)
    pos[n:] = -1
    return idx, pos


def batch_block_inputs(prompts: list[torch.Tensor], start: int, block_size: int):
    """Block `start // block_size` of every sequence of a batch, each at its own positions: idx, input_pos
    [B, block_size], left-aligned (a sequence's block i holds its tokens [start, start + block_size), as its
    batch-1 prefill would; -1 pads a short block, and the whole block once the sequence's prompt has ended)."""
    rows = [block_inputs(p, start, block_size) for p in prompts]
    return torch.cat([idx for idx, _ in rows]), torch.stack([pos for _, pos in rows])


def prefill_one_shot(model, prompt: torch.Tensor, block_size: int, shared: dict | None = None, *,
                     on_prefill=None, row: int | None = None, on_layer=None) -> torch.Tensor:
    """Dense prefill of the prompt layer by layer (model.prefill_layer_major, one layer's whole-prompt scratch at a
    time, slot = position), each layer compressed into its cache (cache.compress_into) before the next runs: the
    SnapKV / RocketKV / kvpress protocol. shared: this forward's cross-layer state (K-VEC's coverage counter).
    on_prefill(L * layers done // layers, L) after each layer; row: compress into that sequence of a batch cache;
    on_layer(i, scratch) before layer i's compression (speculative.py). Returns the last logits [1, vocab]."""
    L = prompt.numel()
    n_layers = len(model.layers)
    n_blocks = -(-L // block_size)
    idx, input_pos = block_inputs(prompt, 0, n_blocks * block_size)
    shared = {} if shared is None else shared

    def layer_cache(i):
        c = model.layers[i].attention.kv_cache
        return c if row is None else row_cache(c, row)

    def scratch(i):
        return scratch_cache(model.layers[i].attention.kv_cache, n_blocks * block_size, L)

    def done(i, scratch):
        runtime.THREADS.tick()
        c = layer_cache(i)
        if on_layer is not None:
            on_layer(i, scratch)
        if c.scorer is None:  # full, Exact-TopK: the scratch already is the whole prompt
            for dst, src in zip([c.pos, *c.slot_buffers()], [scratch.pos, *scratch.slot_buffers()], strict=True):
                dst[:, :, :L] = src[:, :, :L]
        else:
            compress_into(scratch, c, shared)
        if on_prefill is not None:
            on_prefill(L * (i + 1) // n_layers, L)
    return model.prefill_layer_major(idx, input_pos, block_size, scratch, done)


def prefill(model, prompt: torch.Tensor, block_size: int, step=prefill_step, one_shot: bool = False,
            shared: dict | None = None, *, on_prefill=None) -> torch.Tensor:
    """The prompt [L] into the caches: block-wise (`step` on each padded block) or one-shot (prefill_one_shot,
    eager); returns the last position's logits [1, vocab]. The eager step over caches that hold every token at
    slot == position (full, Exact-TopK), where no block boundary decides anything, takes unpadded chunks of at
    least EAGER_CHUNK tokens instead (larger products, fewer calls). on_prefill(done, L), if given, after each block
    with the prompt tokens done (one-shot: after each layer, see prefill_one_shot). It adds no host sync: on CUDA a
    block it reports may still be running (a caller that shows a rate syncs before drawing it)."""
    if one_shot:
        return prefill_one_shot(model, prompt, block_size, shared, on_prefill=on_prefill)
    L = prompt.numel()
    dense = dense_chunk(model, block_size, step)
    with eager_blocks(model, 0, L, step is prefill_step):  # eager: a dense cache's block attends the slots filled
        for start in range(0, L, dense or block_size):
            end = min(start + (dense or block_size), L)
            inputs = (prompt[None, start:end], torch.arange(start, end, device=prompt.device)) if dense else \
                block_inputs(prompt, start, block_size)
            runtime.THREADS.tick()
            logits = step(model, *inputs)
            if on_prefill is not None:
                on_prefill(end, L)
    return logits


EAGER_CHUNK = 512  # llama.cpp's default micro-batch


def dense_chunk(model, block_size: int, step=prefill_step) -> int | None:
    """The unpadded chunk, at least EAGER_CHUNK tokens, that prefill() gives the eager step over caches that hold
    every token at slot == position (full, Exact-TopK); None elsewhere (padded blocks of block_size)."""
    dense = step is prefill_step and all(layer.attention.kv_cache.spec.mode == "dense" for layer in model.layers)
    return max(block_size, EAGER_CHUNK) if dense else None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PeakMemory:
    """Per-phase peak memory: CUDA's max_memory_allocated, or on CPU the process peak RSS (VmHWM), which Linux
    lets us reset by writing 5 to /proc/self/clear_refs. Falls back to ru_maxrss (not resettable) elsewhere."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.measure = "cuda max_memory_allocated" if self.cuda else "process peak RSS, VmHWM"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.measure = "process peak RSS since start, ru_maxrss"

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        try:
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, on_token=None, **kw) -> tuple[list, dict]:
    """One prompt: generate_batch() of a batch of one; returns (generated ids, stats) with the counts as numbers.
    on_token(ids): after every token, with the ids so far."""
    outs, stats = generate_batch(model, [prompt_ids], max_new_tokens,
                                 on_token=None if on_token is None else lambda b, out: on_token(out), **kw)
    return outs[0], one_sequence(stats)


def prefill_batch(model, prompts: list[torch.Tensor], block_size: int, step=prefill_step, one_shot: bool = False,
                  shared: dict | None = None, *, on_prefill=None) -> torch.Tensor:
    """Every prompt of a batch into its row of the caches; each sequence's last-position logits [B, vocab]. One
    prompt: prefill(). Block-wise: one step per block index for the batch, each sequence at its own positions (its
    blocks are its batch-1 blocks; once its prompt ended, padding that changes nothing), its logits from the block
    of its last token. One-shot: each alone through prefill_one_shot into its row, the policy planned for its
    length (replan). on_prefill(done, total) in prompt tokens of the whole batch."""
    if len(prompts) == 1:
        return prefill(model, prompts[0], block_size, step, one_shot, shared, on_prefill=on_prefill)
    total, done = sum(p.numel() for p in prompts), 0
    if one_shot:
        policy = model.layers[0].attention.kv_cache.policy
        planned = dict(vars(policy)) if policy is not None else {}  # the batch's plan, as the decode step saw it
        rows = []
        for b, p in enumerate(prompts):
            replan(model, p.numel())
            rows.append(prefill_one_shot(model, p, block_size, row=b)[0])
            done += p.numel()
            if on_prefill is not None:
                on_prefill(done, total)
        if policy is not None:
            vars(policy).update(planned)  # the same objects again: a compiled decode step's guards still hold
        return torch.stack(rows)
    longest = max(p.numel() for p in prompts)
    last_block = [(p.numel() - 1) // block_size for p in prompts]
    rows = [None] * len(prompts)
    with eager_blocks(model, 0, longest, step is prefill_step):
        for i, start in enumerate(range(0, longest, block_size)):
            runtime.THREADS.tick()
            logits = step(model, *batch_block_inputs(prompts, start, block_size))
            for b in (b for b, last in enumerate(last_block) if last == i):
                rows[b] = logits[b].clone()
            done += sum(min(block_size, max(0, p.numel() - start)) for p in prompts)
            if on_prefill is not None:
                on_prefill(done, total)
    return torch.stack(rows)


def replan(model, prompt_len: int) -> None:
    """Plan the caches' policy for one prompt of a batch (what plan() sizes from the prompt length: SAGE-KV's
    layout, SnapKV++'s kernel) before that prompt's one-shot compression; setup_batch checked that every prompt's
    plan decodes alike."""
    c = model.layers[0].attention.kv_cache
    if c.policy is None:
        return
    if c.run is None:
        raise UserError("a one-shot batch needs its caches from engine.setup_batch (which plans every prompt)")
    c.policy.plan(dataclasses.replace(c.run, prompt_len=prompt_len))


def decode_inputs(token: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's inputs for a batch of any size: ids and positions [B, 1], views of the [B] tensors (what
    warm_up passes too: other shapes or strides would recompile)."""
    return token.view(-1, 1), positions.view(-1, 1)


def decode(model, step, token: torch.Tensor, outs: list[list[int]], positions: list[int], max_new_tokens: int, *,
           eos_ids=(), sampling: Sampling = GREEDY, penalty=None, finished=None, on_token=None, on_done=None,
           stop=None, on_step=None) -> int:
    """The decode loop, for a batch of one or more: feeds each sequence's last token (token [B]) at its next position
    (positions[b], then one more each step) and samples the next (sampling, penalty), until each has its EOS
    (included), max_new_tokens ids or finished(b, ids) (a stop string), or stop() (checked before each step). outs:
    each sequence's ids, appended in place; a finished one keeps stepping (a static batch) but records nothing more.
    on_token(b, ids) after each token, on_done(b, ids) once complete; on_step(logits, seconds) after each step, the
    clock read once its tokens reached the host (the benchmarks time steps by it). Returns the steps run."""
    def more(b: int) -> bool:
        ids = outs[b]
        return ids[-1] not in eos_ids and len(ids) < max_new_tokens and not (finished and finished(b, ids))
    live = [more(b) for b in range(len(outs))]
    for b, out in enumerate(outs):
        if not live[b] and on_done:
            on_done(b, out)
    pos, n_steps = torch.tensor(positions, device=token.device), 0
    while any(live) and not (stop is not None and stop()):
        runtime.THREADS.tick()
        n_steps += 1
        t = time.perf_counter()
        logits = step(model, *decode_inputs(token.clamp_min(0), pos))
        token = sampling.tokens(logits, penalty)
        tokens = token.tolist()
        if on_step is not None:
            on_step(logits, time.perf_counter() - t)
        for b, tok in enumerate(tokens):
            if live[b]:
                check_finite(tok, len(outs[b]))
                outs[b].append(tok)
                if on_token:
                    on_token(b, outs[b])
                live[b] = more(b)
                if not live[b] and on_done:
                    on_done(b, outs[b])
        pos = pos + 1
    return n_steps


@torch.inference_mode()
def generate_batch(model, prompts_ids: list[list[int]], max_new_tokens: int, *, block_size: int, steps,
                   eos_ids=(), sampling: Sampling = GREEDY, finished=None, device="cpu",
                   one_shot=False, shared: dict | None = None, on_prefill=None, on_token=None, on_done=None
                   ) -> tuple[list[list[int]], dict]:
    """Prefill then decode a batch of prompts of any lengths (caches from setup_batch, a row each; steps = (prefill,
    decode)); returns (each sequence's ids, stats: decode tokens over all sequences). Each keeps its own positions
    and kept set (greedy: its batch-1 tokens); decode says when one stops (the repetition penalty starts here, on
    the prompts); shared, on_prefill: see prefill_batch; on_token, on_done: see decode."""
    prefill_fn, decode_fn = steps
    for layer in model.layers:
        layer.attention.kv_cache.reset()
    lens = [len(ids) for ids in prompts_ids]
    if not lens or min(lens) == 0:
        raise UserError("a batch needs at least one prompt, and no prompt may be empty")
    prompts = [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompts_ids]
    check_capacity(model, max(lens), max_new_tokens, one_shot)
    mem = PeakMemory(device)
    # the peak so far: loading and compiling (before the first reset; on CPU the process's peak RSS since it began)
    stats = {"batch_size": len(prompts), "prompt_tokens": lens, "memory_measure": mem.measure,
             "startup_peak_bytes": mem.peak()}

    runtime.release_free_memory()  # what loading (a first run's conversion) freed is not the prefill's
    mem.reset()
    sync(device)
    t0 = time.perf_counter()
    logits = prefill_batch(model, prompts, block_size, prefill_fn, one_shot, shared, on_prefill=on_prefill)
    penalty = sampling.penalty(len(prompts), model.args.vocab_size, device)
    if penalty is not None:
        penalty.start(prompts_ids)
    token, outs = first_tokens(logits, sampling, penalty)
    t1 = time.perf_counter()
    stats.update(ttft_s=t1 - t0, prefill_tok_s=sum(lens) / (t1 - t0), prefill_peak_bytes=mem.peak())
    if on_token:
        for b, out in enumerate(outs):
            on_token(b, out)

    runtime.release_free_memory()
    mem.reset()
    t2 = time.perf_counter()
    n_steps = decode(model, decode_fn, token, outs, lens, max_new_tokens, eos_ids=eos_ids, on_token=on_token,
                     on_done=on_done, finished=finished, sampling=sampling, penalty=penalty)
    sync(device)
    t3 = time.perf_counter()
    n_decode = sum(len(out) - 1 for out in outs)
    stats.update(decode_tokens=n_decode, decode_s=t3 - t2, decode_tok_s=n_decode / (t3 - t2) if n_decode else 0.0,
                 decode_peak_bytes=mem.peak(), generated_tokens=[len(out) for out in outs], decode_steps=n_steps)
    return outs, stats


PREFILLS = ("block", "one-shot")


def prefill_protocol(policy, prefill: str | None) -> str:
    """The prefill protocol for `policy` and a prefill choice (None: the policy's default): "block" or "one-shot".
    A paper that defines its protocol fixes it."""
    if prefill is not None and (not isinstance(prefill, str) or prefill not in PREFILLS):
        raise UserError(f"prefill={prefill!r} is not one of {', '.join(PREFILLS)}")
    if policy is not None and policy.protocol == "one-shot":
        if prefill == "block":
            raise UserError(f"policy={policy.name} compresses the prompt once after a dense prefill; use "
                            "prefill=one-shot (its default)")
        return "one-shot"
    return prefill or "block"


def setup(model, policy, budget: int, prompt_len: int, max_new_tokens: int, block_size: int, *,
          prefill: str = "block", evict_before_attend: bool = False, kv_dtype: torch.dtype | None = None,
          evict: bool = True, batch: int = 1) -> int:
    """Plan `policy` for this run and give every layer its cache of `budget` slots (fewer when the policy's own
    layout needs fewer: SAGE-KV); returns the slots. policy None (`full`) and selector-only policies (Exact-TopK)
    hold every token: budget >= prompt + new tokens. evict=False: the `no-evict` baseline (the same buffer and
    scoring-free steps: nothing is ever dropped)."""
    name = policy.name if policy is not None else "full"
    if not is_scorer(policy) and budget < prompt_len + max_new_tokens:
        raise UserError(f"policy={name} keeps every token: `budget` must be >= prompt + `max_new_tokens` "
                        f"({prompt_len} + {max_new_tokens}); pick an evicting policy to stay within budget={budget}")
    if evict_before_attend and (prefill != "block" or not is_scorer(policy)):
        raise UserError(f"`evict_before_attend` applies to block-wise evicting policies, not to policy={name} "
                        f"with prefill={prefill}")
    if evict_before_attend and budget < block_size:  # else a block's first queries may keep no key to see
        raise UserError(f"`evict_before_attend` needs `budget` >= `block_size` ({budget} < {block_size})")
    slots, keep = budget, None
    run = Run(budget, prompt_len, max_new_tokens, block_size, model.args)
    if policy is not None:
        slots = policy.plan(run) or budget
        keep = policy.prompt_keep(run) if prefill == "one-shot" else None
    setup_caches(model, batch, slots, block_size, policy, evict_before_attend, kv_dtype, keep=keep, evict=evict)
    for layer in model.layers:
        layer.attention.kv_cache.run = run  # what the policy was planned for (replan: one prompt of a batch)
    return slots


def setup_batch(model, policy, budget: int, prompt_lens: list[int], max_new_tokens: int, block_size: int,
                **kw) -> int:
    """setup() for a batch of prompts of these lengths: one cache row per prompt, `budget` slots each. The policy
    is planned for every prompt first: a plan that depends on the prompt's length (SAGE-KV's layout, RocketKV's
    default read) must give every prompt the same slots and the same decode plan (policy.decode_plan), since
    the whole batch decodes as one static shape; otherwise UserError, before anything is allocated."""
    if policy is not None:
        plans = {}
        for L in sorted(set(prompt_lens)):
            slots = policy.plan(Run(budget, L, max_new_tokens, block_size, model.args)) or budget
            plans[L] = (slots, policy.decode_plan())
        (La, pa), *rest = plans.items()
        for Lb, pb in rest:
            if pb != pa:
                raise UserError(f"policy={policy.name} plans a {La}-token and a {Lb}-token prompt differently "
                                f"(slots and decode plan {pa} vs {pb}) and a batch decodes with one plan: "
                                f"{policy.batch_hint or 'run these prompts in separate batches'}")
    return setup(model, policy, budget, max(prompt_lens), max_new_tokens, block_size, batch=len(prompt_lens), **kw)


def check_capacity(model, prompt_len: int, max_new_tokens: int, one_shot: bool) -> None:
    """A cache that never evicts (full, Exact-TopK, and after a one-shot compression SnapKV++, RocketKV, K-VEC) must
    hold the kept prompt plus every token written during decode (the last sampled one is never written).
    Generation past that capacity is an error, never a silent eviction."""
    spec = model.layers[0].attention.kv_cache.spec
    if spec.mode in ("evict", "no-evict"):
        return
    kept = min(prompt_len, spec.keep) if one_shot and spec.mode == "append" else prompt_len
    if kept + max_new_tokens - 1 > spec.budget:
        raise UserError(f"{spec.policy.name if spec.policy else 'full'}: {kept} kept prompt tokens + "
                        f"{max_new_tokens} new tokens exceed the cache's {spec.budget} slots (raise `budget`)")


def decode_bytes_per_step(model) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: each weight once (one embedding row unless tied to the
    output head), K and V of each slot it attends (RocketKV: its top-k's and page scan's; Exact-TopK: its top-k)."""
    emb = model.tok_embeddings.weight
    head = getattr(model.output, "weight", None)
    seen, weights = set(), 0
    if head is None or head.data_ptr() != emb.data_ptr():  # untied (or quantized head): one embedding row is read
        seen.add(emb.data_ptr())
        weights += emb[0].nbytes
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.nbytes
    kv = 0
    for layer in model.layers:
        c = layer.attention.kv_cache
        per_token = sum(t[:, :, :1].nbytes for t in c.kv_buffers())  # K+V (+scales)
        kv += int(per_token * c.read_tokens())
    return weights, kv


# -------------------------------------------------------------------------------------------------------- the run

DEFAULT_NEW_TOKENS, DEFAULT_BLOCK, DEFAULT_BUDGET = 200, 128, 2048  # each clamped to the model's context


class Generation:
    """The run every entry point drives (generate.py, generate_text, chat.Chat, the benchmarks, eval): its settings
    resolved against the model's context and the prompts' lengths when made (a UserError naming the parameter), then
    setup() (the caches, once they fit in memory), compile() (warmed up), generate() (or prefill() and decode()).

    None is the default: max_new_tokens 200 (fewer where the context ends first), block_size 128, budget
    prompt + max_new_tokens for the policies that hold every token (full, exact-topk) and 2048 for the others, each
    clamped to the model's context (`clamped`: {parameter: (default, used)}). prompt_lens None: a conversation
    (chat.py), whose prompts come later: budget 2048 for every policy. prefill: "block" or "one-shot" (None: the
    policy's default). evict=False: the no-evict baseline. The run plans a copy of `policy`, never the caller's.
    fns: the run's (prefill steps, decode steps), which compile() compiles; aot: whether its mode may be AOT."""
    fns, aot = runtime.STEPS, True

    def __init__(self, args: ModelArgs, policy, prompt_lens: list[int] | None = None, *, budget: int | None = None,
                 max_new_tokens: int | None = None, block_size: int | None = None, prefill: str | None = None,
                 evict_before_attend: bool = False, kv_dtype: torch.dtype | None = None, sampling: Sampling = GREEDY,
                 device: str = "cpu", evict: bool = True):
        kernels.check_form()
        if not isinstance(sampling, Sampling):
            raise UserError(f"sampling={sampling!r} is not a sampling.Sampling")
        sampling.check_model(args.vocab_size, args.max_seq_len)
        policy = policies.resolve(policy)
        policy = dataclasses.replace(policy) if dataclasses.is_dataclass(policy) else policy  # its own plan state
        self.args, self.policy, self.sampling, self.evict = args, policy, sampling, evict
        self.device = runtime.check_device(device)
        self.protocol = prefill_protocol(policy, prefill)
        self.evict_before_attend, self.kv_dtype = evict_before_attend, check_kv_dtype(kv_dtype)
        self.lens = None if prompt_lens is None else [check_int("prompt_lens", n, least=1) for n in prompt_lens]
        self.clamped, self.steps, self.slots, self.set_up = {}, (*self.fns[0], *self.fns[1]), None, None
        self.max_new_tokens, self.block_size, self.budget = self.fit(max_new_tokens, block_size, budget)
        self.compile_mode, self.compiled_prefill, self.frozen, self.compile_s, self.compile_cache = \
            None, False, False, 0.0, None

    def fit(self, max_new_tokens, block_size, budget) -> tuple[int, int, int]:
        """(max_new_tokens, block_size, budget) against the context: a default clamped, a value given checked."""
        ctx = self.args.max_seq_len
        for name, value in (("max_new_tokens", max_new_tokens), ("block_size", block_size), ("budget", budget)):
            if value is not None and check_int(name, value, least=1) > ctx:
                raise UserError(f"{name}={value} is larger than the model's context ({ctx})")
        L = max(self.lens) if self.lens else 0
        if self.lens:
            n, longest = len(self.lens), self.lens.index(L) + 1
            what = "the prompt" if n == 1 else f"prompt {longest} of the batch"
            if L > ctx:
                raise UserError(f"{what} has {L} tokens, longer than the model's context of {ctx}")
            if max_new_tokens is None and L >= ctx:
                raise UserError(f"{what} ({L} tokens) fills the model's context ({ctx}): no room for new tokens")
            if max_new_tokens is not None and L + max_new_tokens > ctx:
                total = f"prompt ({L})" if n == 1 else f"the longest prompt (prompt {longest} of the batch, {L} tokens)"
                raise UserError(f"{total} + max_new_tokens={max_new_tokens} exceeds the model's context ({ctx})")
        max_new_tokens = max_new_tokens or self.default("max_new_tokens", DEFAULT_NEW_TOKENS, ctx - max(L, 1))
        block_size = block_size or self.default("block_size", DEFAULT_BLOCK, ctx)
        if budget is None and self.lens and not is_scorer(self.policy):  # full, exact-topk: every token is held
            budget = L + max_new_tokens
        return max_new_tokens, block_size, budget or self.default("budget", DEFAULT_BUDGET, ctx)

    def default(self, name: str, value: int, room: int) -> int:
        if room < value:
            self.clamped[name] = (value, room)
        return min(value, room)

    def kv_bytes_needed(self, dtype: torch.dtype, args: ModelArgs | None = None, lens: list[int] | None = None) -> int:
        """Bytes the caches setup() allocates (every layer's, one row per prompt), plus a one-shot prefill's
        scratch (one layer's K/V of the whole padded prompt): what a model built for this run must leave free.
        args: the model's (a tensor-parallel rank's holds its share of the heads)."""
        args, lens, block = args or self.args, lens or self.lens or [1], self.block_size
        need = len(lens) * kv_cache_estimate(args, self.budget + block, dtype, self.kv_dtype)
        if self.protocol == "one-shot":
            scratch = -(-max(lens) // block) * block
            need += kv_cache_estimate(args, scratch, dtype, self.kv_dtype) // args.n_layers
        return need

    def setup(self, model, prompt_lens: list[int] | None = None) -> int:
        """Every layer's cache for this run's prompts (or `prompt_lens`: a conversation's first turn), after
        checking that they fit in the device's free memory; returns the slots per layer and KV head."""
        lens = prompt_lens or self.lens or [1]
        dtype = model.tok_embeddings.weight.dtype if model.tok_embeddings.weight.is_floating_point() else torch.float32
        n = len(lens)
        check_fits(f"the KV cache of {n} sequence{'s' if n > 1 else ''}", 0, dtype, self.device,
                   self.kv_bytes_needed(dtype, model.args, lens))
        self.slots = setup_batch(model, self.policy, self.budget, lens, self.max_new_tokens, self.block_size,
                                 prefill=self.protocol, evict_before_attend=self.evict_before_attend,
                                 kv_dtype=self.kv_dtype, evict=self.evict)
        self.set_up = (run_caches(self, model), list(lens))  # what prefill() and generate() check they run on
        return self.slots

    def compile(self, model, first_id: int, mode: str | None = None, prefill: bool | None = None,
                freeze: bool = False, around=None, warm: bool = True) -> None:
        """Compile the run's steps (fns; runtime.compile_settings decides how) and warm them up on first_id unless
        not `warm` (the caches are left dirty: generate() resets them). around(self): a context manager for the
        warm-up (generate.py's compiler log and ticker), entered once the mode is settled, whose value is the
        terminal's stream (None: stderr). Sets compile_mode, compiled_prefill, frozen, compile_s, compile_cache."""
        mode, self.compiled_prefill = runtime.compile_settings(model, self.protocol, mode, prefill, freeze, self.aot)
        self.frozen, self.compile_mode = freeze, runtime.mode_name(mode, self.device)
        self.steps = runtime.compile_steps(self.device, mode, self.compiled_prefill, freeze, self.fns)
        decode_step = self.steps[1]
        dynamo = mode != runtime.AOT or self.compiled_prefill
        if dynamo:  # imported here: an eager or AOT run never imports the compiler
            from torch._dynamo.utils import counters
            counters["inductor"].clear()
        t = time.perf_counter()
        with around(self) if around is not None else contextlib.nullcontext() as terminal:
            if mode == runtime.AOT and terminal is not None:
                decode_step.stream = terminal  # a package not loaded or not saved: its line there, not in a log
            if warm:
                check_set_up(self, model)  # the warm-up runs on the caches setup() made
                self.warm_up(model, first_id)
        self.compile_s = time.perf_counter() - t
        self.compile_cache = runtime.cache_state(counters["inductor"] if dynamo else None,
                                                 decode_step if mode == runtime.AOT else None)

    @torch.inference_mode()
    def warm_up(self, model, first_id: int) -> None:
        """Compile (or load) both steps before anything is timed, in the order a run calls them: the prefill step on
        one padded block (a batch: each sequence at its own positions), then the decode step twice with its inputs
        made as decode() makes them (decode_inputs: other shapes or strides would recompile). Twice, since CUDA
        graph trees warm up on a graph's first call and record it on the second; the third call, the first timed
        one, replays. Leaves the caches dirty: reset before use."""
        batch = len(self.lens or [1])
        first = torch.tensor([first_id], device=self.device)
        self.steps[0](model, *batch_block_inputs([first] * batch, 0, self.block_size) if batch > 1 else
                      block_inputs(first, 0, self.block_size))
        for _ in range(2):
            self.steps[1](model, *decode_inputs(torch.full((batch,), first_id, device=self.device),
                                                torch.ones(batch, dtype=torch.long, device=self.device)))
        sync(self.device)
        runtime.release_free_memory()

    def prefill(self, model, prompts: list[list[int]], *, on_prefill=None) -> torch.Tensor:
        """The caches emptied, then every prompt into its row with this run's protocol and prefill step
        (prefill_batch); each sequence's last-position logits [B, vocab]. For a caller that times the phases."""
        check_set_up(self, model, prompts)
        for layer in model.layers:
            layer.attention.kv_cache.reset()
        rows = [torch.tensor(ids, dtype=torch.long, device=self.device) for ids in prompts]
        check_capacity(model, max(len(ids) for ids in prompts), self.max_new_tokens, self.protocol == "one-shot")
        return prefill_batch(model, rows, self.block_size, self.steps[0], self.protocol == "one-shot",
                             on_prefill=on_prefill)

    def decode(self, model, token: torch.Tensor, outs: list[list[int]], positions: list[int], **kw) -> int:
        """The decode loop (engine.decode) with this run's decode step and sampling, to max_new_tokens unless kw
        says otherwise."""
        return decode(model, self.steps[1], token, outs, positions, kw.pop("max_new_tokens", self.max_new_tokens),
                      sampling=self.sampling, **kw)

    def generate(self, model, prompts: list[list[int]], *, eos_ids=(), finished=None, on_token=None, on_done=None,
                 on_prefill=None) -> tuple[list[list[int]], dict]:
        """generate_batch() with this run's settings and steps; returns (each sequence's ids, stats): the timings
        and per-phase peaks, the bytes a decode step reads (weights once for the batch, and KV) and the bandwidth
        they make at the measured steps per second, the cache's size and the compile's record, the slots and the
        tokens held, and why each sequence stopped (stop_reason)."""
        check_set_up(self, model, prompts)
        outs, stats = generate_batch(model, prompts, self.max_new_tokens, block_size=self.block_size,
                                     steps=self.steps, eos_ids=eos_ids, sampling=self.sampling, finished=finished,
                                     device=self.device, one_shot=self.protocol == "one-shot",
                                     on_prefill=on_prefill, on_token=on_token, on_done=on_done)
        stats.update(self.summary(model, stats["decode_steps"] / stats["decode_s"] if stats["decode_steps"] else 0.0,
                                  stats))
        context = "max_new_tokens" in self.clamped
        stats["stop_reason"] = [stop_reason(out, self.max_new_tokens, eos_ids, bool(finished and finished(b, out)),
                                            context) for b, out in enumerate(outs)]
        if len(outs) == 1:
            one_sequence(stats)
        return outs, stats

    def summary(self, model, steps_per_s: float, stats: dict) -> dict:
        """The settings and sizes a run's stats report beside its timings."""
        weight_b, kv_read_b = decode_bytes_per_step(model)
        one_block_wise = self.lens is not None and len(self.lens) == 1 and self.protocol == "block"
        return dict(budget=self.budget, slots=self.slots, tokens_held=int(held(model).max()),
                    slots_read_per_step=model.layers[0].attention.kv_cache.read_tokens(), block_size=self.block_size,
                    prefill_chunk=one_block_wise and dense_chunk(model, self.block_size, self.steps[0]) or
                    self.block_size, prefill=self.protocol, **runtime.THREADS.report(),
                    compiled=self.steps[1] is not model_step, compiled_prefill=self.compiled_prefill,
                    frozen=self.frozen, compile_mode=self.compile_mode, compile_s=round(self.compile_s, 2),
                    compile_cache=self.compile_cache, kv_cache_bytes=kv_bytes(model), weight_bytes=weight_b,
                    kv_read_bytes_per_step=kv_read_b,
                    process_peak_bytes=max(stats["startup_peak_bytes"], stats["prefill_peak_bytes"],
                                           stats["decode_peak_bytes"]),
                    bandwidth_gb_s=(weight_b + kv_read_b) * steps_per_s / 1e9,  # bytes of a step x steps per second
                    max_new_tokens=self.max_new_tokens,
                    clamped_to_context={name: {"default": d, "used": v} for name, (d, v) in self.clamped.items()})


def one_sequence(stats: dict) -> dict:
    """A batch of one's stats as one sequence's: per-sequence values (token counts, stop reason) as scalars."""
    del stats["batch_size"], stats["decode_steps"]
    stats.update({k: stats[k][0] for k in ("prompt_tokens", "generated_tokens", "stop_reason") if k in stats})
    return stats


def held(model) -> torch.Tensor:
    """Tokens every layer's cache holds now (its valid slots): [layers, batch, KV heads]."""
    return torch.stack([layer.attention.kv_cache.n_valid() for layer in model.layers])


def generate_text(prompt: str | list[str], *, checkpoint: str = "smollm2-135m", policy="full",
                  budget: int | None = None, max_new_tokens: int | None = None, block_size: int | None = None,
                  prefill: str | None = None, sampling: Sampling | dict | None = None, stop: list[str] = (),
                  document: str | None = None, seed: int = 0, kv_dtype: str = "auto", dtype: str = "auto",
                  device: str | None = None, chat_template: bool = True, compile: bool = False) -> dict:
    """The Python API in one call, with generate.py's defaults and checks: load `checkpoint` (a short name, an HF or
    budgetkv directory, a .gguf file), set the caches up for `policy` (a spec string, e.g. "snapkv:window=32", or a
    policy object) at `budget`, compile when asked, and generate. sampling: a sampling.Sampling or a dict of its
    fields (default greedy), seeded by `seed`. One prompt returns {"text", "token_ids", **stats}; a list, one batch,
    {"texts", "token_ids" (a list per prompt), **stats}. document: put before the prompt (the question goes last, as
    the one-shot policies assume); stop: strings that end a sequence, cut from its text."""
    device = runtime.check_device(device or runtime.default_device())
    compute = runtime.compute_dtype(dtype, device)
    kv = runtime.check_kv_dtype(kv_dtype, compute)
    sampling = Sampling(**sampling) if isinstance(sampling, dict) else sampling or GREEDY
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(texts, list | tuple) or not texts:
        raise UserError(f"prompt={prompt!r} is neither a text nor a non-empty list of texts")
    texts = [check_text("prompt", t) for t in texts]
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple):
        raise UserError(f"stop={stop!r} is not a list of texts")
    stop = [check_text("stop", s, blank_ok=True) for s in stop]
    document = None if document is None else check_text("document", document)
    check_int("seed", seed, least=0, most=2 ** 63 - 1)
    policy = policies.resolve(policy)
    prefill_protocol(policy, prefill)  # before the checkpoint is looked at
    ckpt = resolve_checkpoint(checkpoint)
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt, compute, device)
    n = len(texts)
    ids = [check_prompt_ids(tokenizer.prompt_ids(t, document, chat_template), model.args.vocab_size,
                            "the prompt" if n == 1 else f"prompt {i + 1} of the batch", str(ckpt))
           for i, t in enumerate(texts)]
    gen = Generation(model.args, policy, [len(i) for i in ids], budget=budget, max_new_tokens=max_new_tokens,
                     block_size=block_size, prefill=prefill, kv_dtype=kv, sampling=sampling, device=device)
    torch.manual_seed(seed)
    gen.setup(model)
    if compile:
        gen.compile(model, ids[0][0], around=progress.compiling)
    stops = StopStrings(stop)
    outs, stats = gen.generate(model, ids, eos_ids=set(tokenizer.eos_ids),
                               finished=(lambda b, out: stops.cut(tokenizer.decode(out)) is not None) if stop else None)
    decoded = [tokenizer.decode(out) for out in outs]
    decoded = [text[:stops.cut(text)] if stops.cut(text) is not None else text for text in decoded]
    if isinstance(prompt, str):
        return {"text": decoded[0], "token_ids": outs[0], **stats}
    return {"texts": decoded, "token_ids": outs, **stats}

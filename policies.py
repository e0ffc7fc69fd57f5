"""KV-cache policies: the registry `name -> policy class`, and every policy as its paper's rule.

A policy is a dataclass: its parameters are typed fields with defaults (the command line is generated from them,
`--policy snapkv:window=32,kernel=7`). It plays one or both of two parts (declared: `scores`, set by the Scorer
base, and `selects`), each a single method over a read-only `cache.View` of one layer (keys, values, positions,
layer index, head counts, declared state, the step's queries):

- a **scorer**, `score(view) -> [batch, n_kv_heads, slots]` fp32: higher = keep, +inf = protected (empty slots are
  set to -inf by cache.py). The engine keeps the `budget` best: block-wise after every prefill block and decode step,
  or once after a dense one-shot prefill (`protocol`; then `decode` says whether new tokens are appended or the
  scorer keeps evicting). Optional: `observe(view)` updates declared state first; `slot_state()` / `layer_state()`
  declare per-slot / per-layer tensors that cache.py allocates (per-slot state moves with its slot).
- a **selector**, `select(view) -> [batch, heads, k]` slot indices: the slots one decode step attends (per KV head,
  or per query head), for decode-time sparse attention. Optional: `prepare(view)` after the one-shot compression,
  `read_tokens(view)` for the traffic accounting, `selector_state()` for its per-layer tensors. The optional hooks
  are no-ops in the base class.

`plan(run)` checks the parameters against one run (budget, prompt length, new tokens, model shape) and sizes what
the run needs. cache.py does every buffer write. docs/architecture.md gives the call order.
"""
import dataclasses
import math
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import attention_mask, drop_lowest, newest, per_row, position_order, take_slots
from errors import UserError

INF = float("inf")


class PolicyError(UserError):
    """An unknown policy or parameters that cannot work; the message is one line for the user."""


INT_LIMIT = 2 ** 31  # an integer parameter counts positions, slots or heads (a seed too): far below this


def param(default, help: str, choices: tuple | None = None):
    """A policy parameter: its default, one line of help, and the values it may take (None: any of its type)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Run:
    """What a policy is planned against: `budget` KV slots held per layer and KV head, the prompt length, the new
    tokens to generate, the prefill block size and the model's ModelArgs (head counts, head_dim, RoPE scaling)."""
    budget: int
    prompt_len: int
    max_new_tokens: int
    block_size: int = 128
    args: Any = None


@dataclass
class Policy:
    """Base of every policy. `protocol`: "any" (the engine's --prefill picks block-wise, the default, or one-shot)
    or "one-shot" (fixed by the paper). `decode`, after a one-shot compression: "evict" (hard budget: new tokens
    compete for the slots) or "append" (new tokens are added after the kept prompt; the prompt keeps budget - new
    tokens)."""
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for the policy table and --help
    protocol: ClassVar[str] = "any"
    decode: ClassVar[str] = "evict"
    scores: ClassVar[bool] = False  # a scorer (Scorer): score(view) ranks the slots to keep
    selects: ClassVar[bool] = False  # a selector: select(view) picks the slots a decode step attends

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise PolicyError(f"{self.name}: {f.name} must be one of {', '.join(map(str, choices))}, "
                                  f"got {value!r}")
            if isinstance(value, float) and math.isnan(value):
                raise PolicyError(f"{self.name}: {f.name} must be a number, got nan")
            if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:  # sizes past torch's int64 arithmetic
                raise PolicyError(f"{self.name}: {f.name} must be between -2**31 and 2**31, got {value}")
        self.validate()

    def validate(self) -> None:
        """Raise PolicyError for parameter values that cannot work whatever the run."""

    def plan(self, run: Run) -> int | None:
        """Check the parameters against one run and size its per-run state. Returns the slots the cache needs
        when a layout of the policy's own holds fewer than run.budget (None: run.budget)."""

    batch_hint: ClassVar[str] = ""  # what to do when a batch's prompts get different decode plans

    def decode_plan(self):
        """What plan() sized that a decode step reads (None: nothing): every prompt of a batch must give the same,
        since the batch decodes as one static shape (engine.setup_batch)."""
        return None

    def prompt_keep(self, run: Run) -> int:
        """How many prompt tokens a one-shot compression keeps per KV head."""
        return run.budget - run.max_new_tokens if self.decode == "append" else run.budget

    # The optional hooks, each a no-op here (cache.py calls them unconditionally).

    def slot_state(self) -> dict:
        """A scorer's per-slot state moved with its slot: name -> (extra shape, dtype); "group" in the shape stands
        for the query heads per KV head."""
        return {}

    def layer_state(self, spec) -> dict:
        """A scorer's per-layer state that stays put, for a cache of this cache.CacheSpec: name -> (shape, dtype,
        fill value)."""
        return {}

    def observe(self, view) -> None:
        """A scorer's update of its declared state before each score (H2O's sums, SnapKV's query ring)."""

    def keep_slots(self, view) -> Tensor | None:
        """A one-shot layout of the policy's own: the scratch slots to keep [B, H, n] (None: the best by score)."""
        return None

    def selector_state(self, spec) -> dict:
        """A selector's per-layer state (as layer_state)."""
        return {}

    def prepare(self, view) -> None:
        """A selector's decode-time state, built after the one-shot compression (RocketKV's pages)."""

    def read_tokens(self, view) -> float | None:
        """Token-equivalents a selector's decode step reads per KV head (None: the slots it attends)."""
        return None


class Scorer(Policy):
    """A policy that evicts by `score(view)`."""
    scores = True

    def score(self, view) -> Tensor:
        raise NotImplementedError


def recent_mask(slot_pos: Tensor, query_pos: Tensor, n_recent: int) -> Tensor:
    """True on the slots holding the `n_recent` latest positions each sequence has seen so far (its step's largest
    query position is its newest)."""
    return slot_pos > newest(query_pos) - n_recent


def protect_recent(scores: Tensor, slot_pos: Tensor, query_pos: Tensor, n_recent: int) -> Tensor:
    """+inf on the slots holding the `n_recent` latest positions seen so far."""
    if n_recent <= 0:
        return scores
    return scores.masked_fill(recent_mask(slot_pos, query_pos, n_recent), INF)


def check_fraction(policy, name: str) -> None:
    p = getattr(policy, name)
    if not 0.0 <= p < 1.0:
        raise PolicyError(f"{policy.name}: {name} must be in [0, 1), got {p}")


def check_odd(policy, name: str) -> None:
    k = getattr(policy, name)
    if k is not None and (k < 1 or k % 2 == 0):
        raise PolicyError(f"{policy.name}: {name} must be odd and >= 1, got {k}")


def check_positive(policy, *names: str, least: int = 1) -> None:
    for name in names:
        v = getattr(policy, name)
        if v is not None and v < least:
            raise PolicyError(f"{policy.name}: {name} must be >= {least}, got {v}")


def all_heads(x: Tensor, view) -> Tensor:
    """x [B, H_kv, ...] of this cache's KV heads -> [B, H_kv of the whole layer, ...]: under tensor parallel
    (tp.py) every rank's heads in order, gathered with a functional collective (traceable: it stays inside a
    compiled step); x itself on one device. For the few rules that read every head of a layer."""
    if view.tp_group is None:
        return x
    from torch.distributed._functional_collectives import all_gather_tensor
    return all_gather_tensor(x.contiguous(), 1, view.tp_group)


def max_over_ranks(x: Tensor, view) -> Tensor:
    """The element-wise max of x over the tensor-parallel ranks (x itself on one device)."""
    if view.tp_group is None:
        return x
    from torch.distributed._functional_collectives import all_reduce
    return all_reduce(x, "max", view.tp_group)


# ------------------------------------------------------------------------------------------- block-wise scorers


@dataclass
class KeyNorm(Scorer):
    """KeyL2Norm (Devoto et al. 2024): keep the keys with the smallest L2 norm. window_frac > 0 always keeps the
    floor(window_frac * budget) newest tokens (the engine's default; window_frac=0 is the paper's rule)."""
    name = "keynorm"
    summary = "keep the keys of smallest L2 norm"
    window_frac: float = param(0.2, "share of the budget always kept for the newest tokens (0: the paper's rule)")

    def validate(self):
        check_fraction(self, "window_frac")

    def score(self, view):
        return protect_recent(-view.keys.float().norm(dim=-1), view.pos, view.query_pos,
                              int(self.window_frac * view.budget))


@dataclass
class Sink(Scorer):
    """StreamingLLM (Xiao et al. 2023): the first n_sink positions plus the most recent tokens. Keys keep their
    absolute positions (no re-assignment inside the cache)."""
    name = "sink"
    summary = "attention sinks + the most recent tokens (StreamingLLM)"
    n_sink: int = param(4, "first positions always kept")

    def validate(self):
        check_positive(self, "n_sink", least=0)

    def plan(self, run):
        if run.budget <= self.n_sink:
            raise PolicyError(f"sink: budget={run.budget} must exceed the {self.n_sink} sink tokens")

    def score(self, view):
        pos = view.pos
        return pos.float().masked_fill((pos >= 0) & (pos < self.n_sink), INF)


@dataclass
class KeyDiff(Scorer):
    """KeyDiff (Park et al., arXiv 2504.15364, Eq. 8, section 3.2): keep the keys least similar to the anchor,
    score_j = -cos(k_j, mu), mu = the mean of the raw post-RoPE keys of the head (cache + block), the paper's
    experimental choice (anchor=normalized: the mean of unit keys, Eq. 7's ranking, as kvpress). window_frac always
    keeps the floor(window_frac * budget) newest tokens: the paper's KeyDiff + SW (0.2, the default) or, with 0, its
    vanilla rule. Reads no queries."""
    name = "keydiff"
    summary = "key diversity: evict keys most similar to the mean key"
    window_frac: float = param(0.2, "share of the budget always kept for the newest tokens (paper's SW: 0.1, 0.2; "
                                    "0: vanilla KeyDiff)")
    anchor: str = param("raw", "mean of the raw keys (paper) or of the unit keys (kvpress)", ("raw", "normalized"))

    def validate(self):
        check_fraction(self, "window_frac")

    def score(self, view):
        return protect_recent(-key_cosine(view, self.anchor), view.pos, view.query_pos,
                              int(self.window_frac * view.budget))


def key_cosine(view, anchor: str) -> Tensor:
    """cos(k_j, mu) [B, H, S]: mu = the mean of the raw keys (anchor raw) or of the unit keys (normalized)."""
    k = view.keys.float()
    norms = k.norm(dim=-1).clamp_min(1e-8)
    src = k if anchor == "raw" else k / norms[..., None]
    valid = (view.pos >= 0)[..., None].float()
    mu = (src * valid).sum(-2) / valid.sum(-2).clamp_min(1.0)
    return (k @ mu[..., None])[..., 0] / (norms * mu.norm(dim=-1, keepdim=True).clamp_min(1e-8))


@dataclass
class TOVA(Scorer):
    """TOVA (Oren et al. 2024), block-wise as in KeyDiff App. F.2: the attention of the step's last query, averaged
    over the query heads of each KV group, evicted per KV head. heads=all averages over all query heads of the layer
    and gives every KV head that one score (the official TOVA code and kvpress); keep_last always keeps the newest
    token (kvpress pads its score with max + 1; the paper does not protect it)."""
    name = "tova"
    summary = "attention of the last query (group mean)"
    heads: str = param("group", "mean over the KV group's query heads (paper) or all heads (kvpress)",
                       ("group", "all"))
    keep_last: bool = param(False, "always keep the newest token (kvpress)")

    def score(self, view):
        q_last, p_last = view.last_query()
        w = view.attention(q_last, p_last)[:, :, 0]  # [B, H_kv, S], mean over each group
        if self.heads == "all":  # groups are equal-sized: the mean of group means is the mean
            w = all_heads(w, view).mean(1, keepdim=True).expand_as(w).contiguous()  # every rank's heads under TP
        return protect_recent(w, view.pos, view.query_pos, int(self.keep_last))

@dataclass
class H2O(Scorer):
    """H2O (Zhang et al. 2023) as KeyDiff and CAOTE use it: the raw running sum of the group-mean attention each
    slot received from every query since it entered, the current block included. window_frac of the budget always
    keeps the newest tokens: the original H2O's equal heavy-hitter / recent split (0.5, the default) or, with 0,
    heavy hitters only (as KeyDiff and CAOTE run it)."""
    name = "h2o"
    summary = "accumulated attention (heavy hitters)"
    per_head: ClassVar[bool] = False  # CAOTE's base: each query head's own sums, acc [B, H, C, G]
    window_frac: float = param(0.5, "share of the budget always kept for the newest tokens (0: heavy hitters only)")

    def validate(self):
        check_fraction(self, "window_frac")

    def slot_state(self):
        return {"acc": (("group",) if self.per_head else (), torch.float32)}

    def observe(self, view):
        w = view.attention(view.q, view.input_pos, group_mean=not self.per_head)  # padding rows (-1) weigh 0
        view.state["acc"] += w.sum(3).transpose(-1, -2) if self.per_head else w.sum(2)

    def score(self, view):
        return protect_recent(view.state["acc"].clone(), view.pos, view.query_pos,
                              int(self.window_frac * view.budget))

@dataclass
class SnapKV(Scorer):
    """SnapKV (Li et al. 2024), block-wise as in KeyDiff: the last `window` queries vote with their attention; the
    votes are average-pooled (stride 1, zero padding counted) along the candidates in position order; the window's
    own tokens are always kept. The last queries live in a ring per layer, so a decode step still votes with
    `window` queries."""
    name = "snapkv"
    summary = "observation-window attention, pooled"
    window: int = param(32, "observation window: the last queries that vote, always kept")
    kernel: int = param(7, "pooling kernel along positions, odd")

    def validate(self):
        check_positive(self, "window")
        check_odd(self, "kernel")

    def plan(self, run):
        if run.budget <= self.window:
            raise PolicyError(f"{self.name}: budget={run.budget} must exceed the observation window "
                              f"({self.window})")

    def ring_size(self) -> int:
        return self.window

    def layer_state(self, spec):
        return {"ring_q": ((spec.batch, spec.n_heads, self.ring_size(), spec.head_dim), torch.float32, 0.0),
                "ring_pos": ((spec.batch, self.ring_size()), torch.long, -1)}

    def observe(self, view):
        """Keep each sequence's `ring_size` latest queries of ring + block (the top positions; padding is -1)."""
        ring_q, ring_pos = view.layer_state["ring_q"], view.layer_state["ring_pos"]
        B, Hq, R, D = ring_q.shape
        cand_pos = torch.cat([ring_pos, per_row(view.input_pos).long().expand(B, -1)], dim=-1)
        latest = cand_pos.topk(R, dim=-1).indices  # [B, R]
        cand_q = torch.cat([ring_q, view.q.float()], dim=2)
        ring_q.copy_(cand_q.gather(2, latest[:, None, :, None].expand(B, Hq, R, D)))
        ring_pos.copy_(cand_pos.gather(-1, latest))

    def score(self, view):
        return pool_votes(window_votes(view), view.pos, view.newest, self.window, self.kernel, "avg")

def window_votes(view, group_mean: bool = True) -> Tensor:
    """Softmax attention of the ring's window queries over the slots (causal: each query sees positions up to its
    own), summed over the window queries, averaged over each KV group's query heads: [B, H_kv, S]
    (group_mean=False: per query head, [B, H_kv, G, S])."""
    return view.attention(view.layer_state["ring_q"], view.layer_state["ring_pos"], group_mean).sum(-2)


def pool_votes(votes: Tensor, pos: Tensor, newest: Tensor, window: int, kernel: int, pool: str) -> Tensor:
    """SnapKV's pooling of votes [B, H, S] along positions (stride 1, same length): `avg` (zero padding counted)
    or `max`. The window (the `window` newest positions) is excluded from the votes (zero, i.e. padding at its
    edge) and protected (+inf). Empty slots (position -1, zero votes) sort first and act as padding too; for max
    pooling of votes >= 0, zero padding equals -inf padding. A kernel wider than 2 S + 1 pools as 2 S + 1 does
    (every window already covers all S slots), so that a huge one costs no more."""
    win = pos > newest - window
    votes = votes.masked_fill(win, 0.0)
    order = pos.argsort(dim=-1)
    B, H, S = votes.shape
    kernel = min(kernel, 2 * S + 1)
    v = votes.gather(-1, order).view(B * H, 1, S)
    if pool == "avg":
        pooled = F.avg_pool1d(v, kernel, 1, kernel // 2, count_include_pad=True)
    else:
        pooled = F.max_pool1d(v, kernel, 1, kernel // 2)
    return torch.zeros_like(votes).scatter(-1, order, pooled.view(B, H, S)).masked_fill(win, INF)



@dataclass
class RandomScores(Scorer):
    """A seeded hash of (position, head): the floor every real policy must beat, and a neutral scorer for testing
    the cache mechanics. Static and deterministic (no RNG state), so compiled == eager; the head is the model's
    KV head index (view.head0 + local index), so a tensor-parallel rank scores its heads as one device does."""
    name = "random"
    summary = "seeded random eviction (the floor)"
    seed: int = param(0, "seed of the hash (independent of --seed, which seeds sampling)")

    def score(self, view):
        pos = view.pos.double()
        head = torch.arange(view.head0, view.head0 + pos.shape[1], device=pos.device,
                            dtype=torch.float64)[None, :, None]
        x = torch.sin(pos * 12.9898 + head * 78.233 + self.seed * 37.719) * 43758.5453
        return (x - x.floor()).float()


# --------------------------------------------------------------------------------------------------------- CAOTE
# CAOTE (Goel et al., arXiv 2504.14051): a modifier of any scorer that can score each query head (HEAD_SCORES).


def caote_scores(h: Tensor, v: Tensor, valid: Tensor, fast: bool = False) -> Tensor:
    """CAOTE's eviction error (paper Eq. 8, 21): if slot j alone left, the (pseudo) attention
    output of query head g would move by c_gj = h~_gj / (1 - h~_gj) * ||X~_g - v_j||, where h~ = the base scores
    h [B, H, G, S] (>= 0) normalised over the valid slots and X~_g = sum_j h~_gj v_j (the real output when h is an
    attention row: TOVA). FastCAOTE (Eq. 23): X~ = the plain mean of the valid values, shared by the group.
    A group's errors combine as the L2 norm of their concatenation: [B, H, S].
    Values v [B, H, S, D] fp32. ||X - v||^2 is expanded around the mean value (no [G, S, D] temporary; centring
    keeps the cancellation small when v_j is close to X)."""
    h = h * valid[:, :, None]
    hn = h / h.sum(-1, keepdim=True).clamp_min(1e-12)
    w = hn / (1 - hn).clamp_min(1e-6)
    n = valid.sum(-1)[..., None, None].clamp_min(1)
    vbar = (v * valid[..., None]).sum(2, keepdim=True) / n  # [B, H, 1, D]
    vc = (v - vbar) * valid[..., None]
    x = torch.zeros_like(vbar) if fast else hn @ vc  # centred X~: [B, H, 1 or G, D]
    d2 = (vc * vc).sum(-1)[:, :, None] - 2 * (x @ vc.transpose(-1, -2)) + (x * x).sum(-1, keepdim=True)
    c = w * d2.clamp_min(0).sqrt()
    return c.square().sum(2).sqrt()


def keydiff_heads(base, view) -> tuple[Tensor, Tensor]:
    """1 - cos >= 0 (an affine map of KeyDiff's score), the same for every query head of a group."""
    h = 1.0 - key_cosine(view, base.anchor)
    return (h[:, :, None].expand(-1, -1, view.group, -1),
            recent_mask(view.pos, view.query_pos, int(base.window_frac * view.budget)))


def tova_heads(base, view) -> tuple[Tensor, Tensor]:
    """Each query head's own last-row attention [B, H, G, S] (sums to 1: CAOTE's exact case)."""
    q_last, p_last = view.last_query()
    w = view.attention(q_last, p_last, group_mean=False)[:, :, :, 0]
    return w, recent_mask(view.pos, view.query_pos, int(base.keep_last))


def h2o_heads(base, view) -> tuple[Tensor, Tensor]:
    """Each query head's own accumulated attention (H2O's per-slot state, kept per query head under CAOTE)."""
    return (view.state["acc"].transpose(-1, -2),
            recent_mask(view.pos, view.query_pos, int(base.window_frac * view.budget)))


def snapkv_heads(base, view) -> tuple[Tensor, Tensor]:
    """Each query head's pooled votes; the protected window keeps its raw votes, so that CAOTE's pseudo-output
    still counts the attention the window receives."""
    votes = window_votes(view, group_mean=False)  # [B, H, G, S]
    B, H, G, S = votes.shape
    pooled = pool_votes(votes.reshape(B, H * G, S), view.pos.repeat_interleave(G, 1), view.newest, base.window,
                        base.kernel, "avg").view(B, H, G, S)
    win = recent_mask(view.pos, view.query_pos, base.window)
    return torch.where(win[:, :, None], votes, pooled), win


# A CAOTE base: its scores per query head, non-negative ([B, H_kv, G, S]), and the slots it protects ([B, H_kv, S]).
HEAD_SCORES = {H2O: h2o_heads, TOVA: tova_heads, SnapKV: snapkv_heads, KeyDiff: keydiff_heads}


class CAOTE:
    """CAOTE over a base scorer (`caote:h2o|tova|snapkv|keydiff`, `fastcaote:...`; section 3.2-3.3): the base scores
    each query head's slots (HEAD_SCORES: non-negative, plus the slots it protects), CAOTE re-ranks them by the
    error their eviction alone would cause in that head's attention output, and the lowest are dropped. The base
    keeps its own parameters, state (H2O's sums, per query head here; SnapKV's query ring) and protection (+inf).
    KeyDiff enters as 1 - cos; SnapKV's protected window enters the pseudo-output with its raw votes. The SnapKV
    base is this engine's (a ring of the last 32 queries, average pooling, protected window), not the paper's
    block-local variant. Ties keep the newer token, as everywhere in the engine."""
    base: ClassVar[type] = None
    fast: ClassVar[bool] = False
    per_head: ClassVar[bool] = True

    def validate(self):
        super().validate()
        if getattr(self, "heads", "group") != "group":
            raise PolicyError(f"{self.name} scores each query head: heads=all is not supported")

    def score(self, view):
        h, protected = HEAD_SCORES[self.base](self, view)
        return caote_scores(h, view.values.float(), view.pos >= 0, self.fast).masked_fill(protected, INF)


def caote_policies() -> list:
    """caote:<base> and fastcaote:<base> for every base that can score each query head."""
    out = []
    for base in HEAD_SCORES:
        for fast in (False, True):
            kind = "fastcaote" if fast else "caote"
            what = "mean-value " if fast else ""
            ns = dict(name=f"{kind}:{base.name}", base=base, fast=fast, __doc__=CAOTE.__doc__,
                      summary=f"CAOTE ({what}attention-output error) over {base.name}'s scores")
            out.append(dataclass(type(f"{kind}_{base.name}", (CAOTE, base), ns)))
    return out


# ------------------------------------------------------------------------------------------------------- RocketKV
# RocketKV (Behnam et al., arXiv 2502.14051 v1): stage 1 SnapKV++ compresses the prompt once after a dense prefill
# (section 3.3); stage 2 hybrid attention picks k tokens of the kept cache at every decode step (section 3.4).
# Exact-TopK is the oracle (section 4.1). docs/policies.md states each choice the paper leaves open.


def adaptive_kernel(prompt_len: int, model_args=None) -> int:
    """SnapKV++'s pooling kernel (section 4.4.2, App. A.3): 511 for long prompts, else 63. Thresholds compare T with
    48*1024 for Llama-3.1 and 12*1024 for LongChat; the model is told apart by its RoPE scaling (llama3 / linear x8);
    models the paper did not run (Mistral, Qwen, SmolLM2) always get 63."""
    scaling = (getattr(model_args, "rope_scaling", None) or {}).get("rope_type")
    threshold = {"llama3": 48 * 1024, "linear": 12 * 1024}.get(scaling)
    return 511 if threshold is not None and prompt_len >= threshold else 63


@dataclass(frozen=True)
class RocketParams:
    """One run's static sizes (paper section 4): storage C per KV head, prompt budget P = C - N, page size p,
    channels r, exact top-k k, pages Np = ceil(C / p). sparse=False: nothing to select, dense attention."""
    S: int
    t: int
    D: int
    C: int
    P: int
    p: int
    r: int
    k: int
    Np: int
    sparse: bool = True

    @property
    def approx_tokens(self) -> float:
        """Token-equivalents of the page scan: r rows of Np (one of min/max per channel) over 2D per token."""
        return self.Np * self.r / (2 * self.D) if self.sparse else 0.0


def rocket_params(S: int, t: int, D: int, N: int, alpha="0.5") -> RocketParams:
    """The paper's parameterisation (its section 4): from S = prompt + new tokens and the token budget t, the
    storage C = floor(S / c^a) with c = S / t (a = 0.5, v1's even split: C = isqrt(S t) exactly; `icml`: a =
    min(0.2 + 0.06 log2 c, 0.8)), at least min(2N, S); then rocket_sizes(C, t). t >= S: no compression, dense.
    The engine takes C as --budget and t as rocketkv's `read`; this gives the pair a paper's t corresponds to."""
    c = max(1.0, S / t)
    if c == 1.0:
        return RocketParams(S, t, D, C=S, P=S - N, p=1, r=D, k=S, Np=S, sparse=False)
    a = min(0.2 + 0.06 * math.log2(c), 0.8) if str(alpha) == "icml" else float(alpha)
    C = math.isqrt(S * t) if a == 0.5 else math.floor(S / c ** a)
    return rocket_sizes(max(C, min(2 * N, S)), t, D, N, S)


def rocket_sizes(C: int, t: int, D: int, N: int, S: int) -> RocketParams:
    """Stage 2's sizes from storage C (slots per KV head), the per-step token budget t and S = prompt + new tokens:
    c2 = C / t, page size p = min(floor(c2), ceil(sqrt(c2))), channels r = clamp(round(D p / c2), 1, D), exact
    top-k = round(t / 2) (half of t for the exact attention, the rest for the page scan), Np = ceil(C / p) pages,
    prompt slots P = C - N. t >= S (the paper's c = 1) or t > C: nothing to select, dense attention."""
    if t >= S or t > C:
        return RocketParams(S, t, D, C=C, P=C - N, p=1, r=D, k=C, Np=C, sparse=False)
    c2 = C / t
    p = min(math.floor(c2), math.ceil(math.sqrt(c2)))
    r = min(max(round(D * p / c2), 1), D)
    return RocketParams(S, t, D, C=C, P=C - N, p=p, r=r, k=min(round(t / 2), C), Np=-(-C // p))


def build_pages(k: Tensor, valid: Tensor, p: int) -> Tensor:
    """Per-page element-wise key min and max (section 3.4) of keys k [B, H, C, D] over pages of p slots, aligned to
    slot 0, only valid slots counted; stored channel-major: [B, H, 2D, Np], rows [0, D) = min,
    [D, 2D) = max. Pages with no valid slot hold 0 (never read: their tokens are masked)."""
    B, H, C, D = k.shape
    Np = -(-C // p)
    pad = Np * p - C
    inf = torch.tensor(INF, dtype=k.dtype, device=k.device)
    valid = F.pad(valid, (0, pad), value=False)[..., None]
    kp = F.pad(k, (0, 0, 0, pad))
    kmin = torch.where(valid, kp, inf).view(B, H, Np, p, D).amin(3)
    kmax = torch.where(valid, kp, -inf).view(B, H, Np, p, D).amax(3)
    empty = ~valid.view(B, H, Np, p).any(-1, keepdim=True)
    return torch.cat([kmin, kmax], -1).masked_fill(empty, 0.0).transpose(-1, -2)


def update_page(pages: Tensor, k_new: Tensor, slot: Tensor, p: int) -> None:
    """Fold the key k_new [B, H, 1, D] just written at slot [1] (every sequence's) or [B, 1] (each its own) into
    page slot // p, in place; the page's first slot overwrites min and max (no +-inf arithmetic, same result)."""
    B, H, D2, _ = pages.shape
    D = k_new.shape[-1]
    slot = per_row(slot).expand(B, 1)
    j = torch.div(slot, p, rounding_mode="floor").clamp_max(pages.shape[-1] - 1)
    col_idx = j.view(B, 1, 1, 1).expand(B, H, D2, 1)
    kn = k_new.transpose(-1, -2).to(pages.dtype)  # [B, H, D, 1]
    col = pages.gather(3, col_idx)
    first = (slot % p == 0).view(B, 1, 1, 1)
    lo = torch.where(first, kn, torch.minimum(col[:, :, :D], kn))
    hi = torch.where(first, kn, torch.maximum(col[:, :, D:], kn))
    pages.scatter_(3, col_idx, torch.cat([lo, hi], 2))


def hybrid_scores(Q: Tensor, pages: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Approximate page scores of queries Q [B, H, G, D] (the G query heads of each KV group), section 3.4 Algorithm 2,
    i1 = top-r channels of the group-summed |q| (shared by the group); per channel the max row where the
    group-summed q >= 0 (as in Algorithm 2), else the min row; each head's own q[i1] times those rows.
    Returns page scores [B, H, G, Np] and the SparQ temperature tau = sqrt(D |q[i1]|_1 / |q|_1) [B, H, G, 1]."""
    B, H, G, D = Q.shape
    i1 = Q.abs().sum(2).topk(r, dim=-1).indices  # [B, H, r]
    rows = i1 + D * (Q.sum(2).gather(-1, i1) >= 0)
    Kh = take_slots(pages, rows).float()  # [B, H, r, Np]
    Qh = Q.gather(-1, i1[:, :, None].expand(B, H, G, r))
    tau = (D * Qh.abs().sum(-1, keepdim=True) / Q.abs().sum(-1, keepdim=True).clamp_min(1e-30)).sqrt()
    return Qh @ Kh, tau


def stable_topk(scores: Tensor, k: int) -> Tensor:
    """Indices of the k highest fp32 scores along the last dim, ties to the lower index (the selection never
    depends on torch.topk's tie order), in ascending order (contiguous reads). A stable argsort costs several topks on
    CPU, so the topk runs on a float64 key that breaks ties without reordering distinct fp32 scores:
    s - |s| i 2^-50 + (n - i) 2^-1000 for index i < n <= 2^20 (the first term moves a score by < 2^-30 of itself,
    below fp32's spacing; the second only separates exact zeros). +-inf scores stay +-inf."""
    n = scores.shape[-1]
    i = torch.arange(n, device=scores.device, dtype=torch.float64)
    s = scores.double()
    key = s - s.abs().nan_to_num(posinf=0.0) * (i * 2.0 ** -50) + (n - i) * 2.0 ** -1000
    return key.topk(k, dim=-1).indices.sort(dim=-1).values


def token_scores(page_scores: Tensor, tau: Tensor, valid: Tensor, p: int) -> Tensor:
    """Per-slot selection scores [B, H, C] for the token top-k: page scores broadcast to their p slots,
    slots not attendable (valid [B, H, C] False) at -inf, per-head softmax(scores / tau) summed over the group;
    slots not attendable then score -1, below every attendable one."""
    B, H, G, Np = page_scores.shape
    C = valid.shape[-1]
    St = page_scores[..., None].expand(B, H, G, Np, p).reshape(B, H, G, Np * p)[..., :C]
    St = St.masked_fill(~valid[:, :, None], -INF)
    return (St / tau).softmax(-1).sum(2).masked_fill(~valid, -1.0)


@dataclass
class SnapKVPlusPlus(SnapKV):
    """SnapKV++ (RocketKV stage 1, section 3.3 and Algorithm 1), one-shot: after a dense prefill each layer keeps, per
    KV head, the window (the last `window` prompt tokens, the last one included) plus the prompt tokens of highest
    window attention (softmax in fp32, summed over the window queries and over the group's query heads: one set per
    KV head), max-pooled along positions with the adaptive kernel (63; 511 for prompts >= 48K on Llama-3.1 and
    >= 12K on LongChat-style linear scaling). The kept slots are in position order. New tokens are appended: the
    prompt keeps budget - max_new_tokens."""
    name = "snapkv++"
    summary = "RocketKV stage 1: one-shot GQA SnapKV, max-pooled (kernel 63/511)"
    protocol = "one-shot"
    decode = "append"
    kernel: int | None = param(None, "max-pool kernel, odd (default: the paper's adaptive 63 / 511)")
    run_kernel = None

    def plan(self, run):
        self.check_prompt_budget(run, f"budget={run.budget} - max_new_tokens={run.max_new_tokens}")
        self.run_kernel = self.kernel or adaptive_kernel(run.prompt_len, run.args)

    def check_prompt_budget(self, run, how):
        P = self.prompt_keep(run)
        if run.prompt_len > P and P < self.window:
            raise PolicyError(f"{self.name} keeps {how} = {P} prompt tokens, fewer than its observation window "
                              f"({self.window}): raise `budget`")

    def layer_state(self, spec):
        return super().layer_state(spec) if spec.mode == "scratch" else {}  # the query ring lives in the prefill scratch

    def score(self, view):  # view.attention averages a group; x G = the paper's group sum
        kernel = self.run_kernel or self.kernel or adaptive_kernel(view.S)
        return pool_votes(window_votes(view) * view.group, view.pos, view.newest, self.window, kernel, "max")


@dataclass
class RocketKV(SnapKVPlusPlus):
    """RocketKV (section 3): SnapKV++ keeps budget - max_new_tokens prompt tokens, then every decode step hybrid
    attention (section 3.4) attends exactly over k = read / 2 tokens picked by per-page key min/max (page p) and the
    top-r channels of |q|, all selections per KV head and shared by its group. `read` is the paper's token budget t
    (tokens read per KV head per decode step, the page scan included); from budget C and t, exactly as the paper's
    even split: c2 = C / t, p = min(floor(c2), ceil(sqrt(c2))), r = clamp(round(D p / c2), 1, D), k = round(t / 2).
    Default read: the even split's t = C^2 / (prompt + new tokens), so that C ~= sqrt(S t). Pages [B, H_kv, 2D, Np]
    (min rows then max rows) over slot order, aligned to slot 0; slots are in position order (sorted after stage 1,
    then appended), updated in place each step. The new token is a candidate, nothing is forced in (local_window n
    pins the n newest, inside k). Ties go to the lower slot. read >= budget: dense attention, no selection."""
    selects = True
    name = "rocketkv"
    summary = "SnapKV++ then hybrid top-k attention each decode step"
    read: int | None = param(None, "tokens read per KV head per decode step, t (default: budget^2 / (prompt + new))")
    local_window: int = param(0, "always attend the n newest tokens, counted inside the top-k")
    rp = None

    def validate(self):
        check_positive(self, "read")
        check_positive(self, "local_window", least=0)

    def plan(self, run):
        S = run.prompt_len + run.max_new_tokens
        t = self.read or max(1, round(run.budget * run.budget / S))
        self.rp = rocket_sizes(run.budget, t, run.args.head_dim, run.max_new_tokens, S)
        super().plan(run)
        if self.local_window > self.rp.k:
            raise PolicyError(f"rocketkv: local_window {self.local_window} must not exceed k = {self.rp.k} (it is "
                              "counted in the top-k)")

    batch_hint = "give rocketkv:read=N (the default read depends on each prompt's length)"

    def decode_plan(self):
        rp = self.rp
        return rp.sparse, rp.p, rp.r, rp.k, rp.Np

    def selector_state(self, spec):
        if not self.rp.sparse:
            return {}
        shape = (spec.batch, spec.kv_heads, 2 * spec.head_dim, -(-spec.budget // self.rp.p))
        return {"pages": (shape, spec.dtype, 0.0)}

    def prepare(self, view):
        if self.rp.sparse:
            view.layer_state["pages"].copy_(build_pages(view.keys, view.pos >= 0, self.rp.p))

    def select(self, view):
        if not self.rp.sparse:
            return None
        rp, pages = self.rp, view.layer_state["pages"]
        update_page(pages, view.key_rows(view.slot), view.slot, rp.p)
        B, Hq, _, D = view.q.shape
        scores, tau = hybrid_scores(view.q.float().reshape(B, view.n_kv_heads, view.group, D), pages, rp.r)
        agg = token_scores(scores, tau, attention_mask(view.pos, view.query_pos, view.window)[:, :, 0], rp.p)
        agg = protect_recent(agg, view.pos, view.query_pos, self.local_window)
        return stable_topk(agg, min(rp.k, view.S))

    def read_tokens(self, view):
        return self.rp.k + self.rp.approx_tokens if self.rp is not None and self.rp.sparse else None


@dataclass
class ExactTopK(Policy):
    """Exact-TopK, the accuracy ceiling (RocketKV section 4.1): nothing is evicted (the budget holds prompt + new
    tokens, like `full`); each decode step computes the exact attention logits over the whole cache and each QUERY
    head attends its own top k (as the official oracle: a group's union can exceed k); the selection is free."""
    selects = True
    name = "exact-topk"
    summary = "oracle: exact attention over each query head's top-k of the full cache"
    k: int = param(256, "slots each query head attends per decode step")

    def validate(self):
        check_positive(self, "k")

    def select(self, view):
        B, Hq, _, D = view.q.shape
        logits = torch.einsum("bhgd,bhsd->bhgs", view.q.float().reshape(B, view.n_kv_heads, view.group, D),
                              view.keys.float())
        valid = attention_mask(view.pos, view.query_pos, view.window)[:, :, 0]
        logits = logits.masked_fill(~valid[:, :, None], -INF)
        k = min(self.k, view.S)
        return stable_topk(logits, k).view(B, Hq, k)

    def read_tokens(self, view):  # each query head reads its own top-k: up to G k per KV head
        return min(view.group * self.k, view.S)


# ------------------------------------------------------------------------------------------------------- SAGE-KV
# SAGE-KV (Wang et al., "LLMs Know What to Drop", arXiv 2503.08879, section 2 and App. A.3): a dense one-shot
# prefill, then ONE token- and head-level top-k per layer from the last prompt token's query; during decode only
# the recent window slides.


def sage_sizes(B: int, G: int, sink: int | None = None, topk: int | None = None) -> tuple[int, int, int]:
    """(S, k, W) for the paper's budget B (slots a decode step reads, the current token included: --budget + 1) and
    GQA group G (paper App. A.3): sink S = B/4, k = B/(2G) per query head floored to a power of two (Qwen's 585 ->
    512), ring W = B - S - G k, counting the current token, so that S + G k + W = B. sink / topk override S / k
    (k = 0: the paper's StreamLLM_Abs)."""
    S = B // 4 if sink is None else sink
    if topk is None:
        if B < 2 * G:
            raise PolicyError(f"sagekv: B = `budget` + 1 = {B} is below 2 x the GQA group ({G}): no token to select "
                              "per query head (sagekv:topk=0 keeps sink + recent only)")
        topk = 1 << ((B // (2 * G)).bit_length() - 1)  # the largest power of two <= B / (2G)
    W = B - S - G * topk
    if W < 1:
        raise PolicyError(f"sagekv: B = `budget` + 1 = {B} leaves no recent window: sink {S} + {G} query heads x "
                          f"top-k {topk} = {S + G * topk} slots")
    return S, topk, W


@dataclass(frozen=True)
class SageLayout:
    """One run's slot layout per KV head, fixed once the prompt length N is known:

        [0, n_sink)                          sink: positions 0 .. n_sink-1
        [n_sink, ring_start)                 G blocks of kk: block g = the top-kk of query head j G + g
        [ring_start, ring_start + W - 1)     the recent ring: the W - 1 newest tokens
        slot `budget` (the decode tail)      the current token, so a decode step attends S + kk + W per query head

    n_sink = min(S, N), kk = min(k, n_E) with candidates E = [n_sink, rs), rs = max(n_sink, N - W): the sink and
    selection hold no empty slot (masked empty slots are left out, not stored), so that decode eviction
    can only ever replace a ring token (empty slots score -inf in cache.drop_to)."""
    S: int
    k: int
    W: int
    G: int
    N: int

    @property
    def n_sink(self) -> int:
        return min(self.S, self.N)

    @property
    def rs(self) -> int:
        return max(self.n_sink, self.N - self.W)

    @property
    def kk(self) -> int:
        return min(self.k, self.rs - self.n_sink)

    @property
    def ring_start(self) -> int:
        return self.n_sink + self.G * self.kk

    @property
    def budget(self) -> int:
        return self.ring_start + self.W - 1


@dataclass
class SageKV(Scorer):
    """SAGE-KV (paper section 2, Steps 1-4; App. A.3), one-shot: each layer keeps the sink [0, S), for EVERY QUERY
    HEAD its own top-k of the candidates [S, N - W) by the logits of the last prompt token's post-RoPE query (q . k
    in fp32, the softmax's ranking; that one query, no window), and a recent ring. Decode: a query head attends
    sink + its own k + the ring + the current token; each new token enters the ring, and the oldest ring token is
    gone for good. The paper's budget B counts the current token: B = --budget + 1, S = B / 4, k = B / (2 G)
    floored to a power of two, ring W = B - S - G k. A token picked by two query heads is stored twice; keys keep
    their absolute positions; ties go to the lower position; each head's selection is in position order.
    skip_if_fits keeps a prompt dense when prompt + new tokens fit (the paper's literal rule always selects).
    Engine form: `keep_slots` lays the cache out (sink, G blocks of k, ring); `select` is a constant slot pattern
    per query head; `score` protects sink and selection (+inf) and ranks the ring by recency, so the oldest ring
    token is dropped and the new token takes its slot."""
    selects = True
    name = "sagekv"
    summary = "one-shot top-k per query head from the last prompt query + sink + sliding window"
    protocol = "one-shot"
    sink: int | None = param(None, "sink tokens S (default: the paper's B / 4)")
    topk: int | None = param(None, "tokens selected per query head (default: B / (2 G) floored to a power of two; "
                                   "0 = sink + recent only)")
    skip_if_fits: bool = param(False, "keep a prompt dense when prompt + new tokens fit in the budget")
    layout = None

    def validate(self):
        check_positive(self, "sink", "topk", least=0)

    def plan(self, run):
        G = run.args.n_heads // run.args.n_kv_heads
        B = run.budget + 1  # the paper's B counts the token being generated
        if self.skip_if_fits and run.prompt_len + run.max_new_tokens <= B:
            S, k, W = run.prompt_len, 0, B - run.prompt_len  # the whole prompt as "sink": nothing is dropped
        else:
            S, k, W = sage_sizes(B, G, self.sink, self.topk)
        self.layout = SageLayout(S, k, W, G, run.prompt_len)
        return self.layout.budget

    batch_hint = "batch prompts of at least sink + top-k + ring tokens, which all get the same layout"

    def decode_plan(self):
        lay = self.layout
        return lay.n_sink, lay.kk, lay.ring_start, lay.W

    def keep_slots(self, view):
        """Steps 1-3 for one layer: the scratch slots of the sink, each query head's top-kk of the candidates and
        the W - 1 newest prompt tokens, in that order."""
        lay = self.layout
        B, H = view.pos.shape[:2]
        dev = view.pos.device
        by_pos = position_order(view.pos)[..., :lay.N]  # the slot of position i
        keep = [torch.arange(lay.n_sink, device=dev).expand(B, H, -1)]
        if lay.kk > 0:
            q_last, _ = view.last_query()  # [B, Hq, 1, D], post-RoPE at position N - 1
            cand = take_slots(view.keys, by_pos[..., lay.n_sink:lay.rs]).float()  # [B, H, n_E, D]
            logits = torch.einsum("bhgd,bhnd->bhgn", q_last.float().view(B, H, lay.G, view.head_dim), cand)
            keep.append((stable_topk(logits, lay.kk) + lay.n_sink).view(B, H, lay.G * lay.kk))
        keep.append(torch.arange(max(lay.rs, lay.N - lay.W + 1), lay.N, device=dev).expand(B, H, -1))
        return by_pos.gather(-1, torch.cat(keep, dim=-1))

    def select(self, view):
        """Query head j G + g attends the sink, its own block g of the selection, the ring and the new token."""
        lay = self.layout
        if lay.kk == 0:  # no selection: every head sees the same slots, i.e. dense attention
            return None
        B, Hq = view.q.shape[:2]
        G, kk, dev = lay.G, lay.kk, view.q.device
        own = lay.n_sink + kk * torch.arange(G, device=dev)[:, None] + torch.arange(kk, device=dev)  # [G, kk]
        shared = torch.cat([torch.arange(lay.n_sink, device=dev), torch.arange(lay.ring_start, view.budget,
                                                                                device=dev), view.slot])
        per_head = torch.cat([own, shared.expand(G, -1)], dim=1)  # [G, n]
        return per_head.repeat(Hq // G, 1).expand(B, -1, -1).contiguous()

    def score(self, view):
        """Decode: +inf on sink and selection, recency (the position) on the ring and the new token."""
        recency = view.pos.float()
        return recency.masked_fill(torch.arange(view.S, device=recency.device) < self.layout.ring_start, INF)


# --------------------------------------------------------------------------------------------------------- K-VEC
# K-VEC ("Coverage-Driven KV Cache Eviction for Efficient and Improved Inference of LLM", anonymous TMLR
# submission): one-shot SnapKV-style selection per layer (section 4, Eq. 8) plus a cross-head module (4.1) and a
# cross-layer coverage bonus (4.2) computed layer by layer in the prefill pass. The equations are pure functions.


def window_means(A: Tensor, q_pos: Tensor, O: int, O2: int, head_max=None) -> tuple[Tensor, Tensor, Tensor]:
    """Eqs. 8, 11, 13 from per-query-head attention rows A [B, H_kv, G, R, S] of queries at positions q_pos [R] or
    [B, R] (-1 = unused row; rows in any order). P, P2 [B, H_kv, S]: mean attention each slot receives from the last
    O and last O2 queries, averaged over each KV group's query heads. I [B, S]: max over ALL query heads, then the
    mean over the last O queries (Eq. 13; not max_h P). Means, not SnapKV's sums, over the queries that
    exist (a prompt shorter than the window has fewer). head_max: completes the max over the heads of other ranks
    (tensor parallel: max_over_ranks)."""
    qp = per_row(q_pos)
    latest = qp.amax(-1, keepdim=True)

    def last(x, n):  # mean over the rows (dim -2) of the n newest queries of each sequence
        rows = ((qp >= 0) & (qp > latest - n)).to(x.dtype)
        rows = rows.view(rows.shape[0], *[1] * (x.dim() - 3), rows.shape[1], 1)
        return (x * rows).sum(-2) / rows.sum(-2).clamp_min(1)
    A_kv = A.mean(2)
    A_max = A.amax(dim=(1, 2))
    return last(A_kv, O), last(A_kv, O2), last(A_max if head_max is None else head_max(A_max), O)


def head_spread(P: Tensor, cand: Tensor) -> Tensor:
    """Eq. 10: sigma [B, H], the population std of each head's score over its candidate slots only."""
    n = cand.sum(-1).clamp_min(1)
    x = P.masked_fill(~cand, 0.0)
    mean = x.sum(-1, keepdim=True) / n[..., None]
    return ((x - mean).masked_fill(~cand, 0.0) ** 2).sum(-1).div(n).sqrt()


def cross_head(P: Tensor, P2: Tensor, cand: Tensor, delta: int, gather=None, head0: int = 0) -> Tensor:
    """Eqs. 9-11 (Alg. 1 lines 2-7): the delta heads of LOWEST sigma (least focused, against Alg. 1's
    comment; ties to the lower head index), measured on P, take their long-window score P2. Under tensor parallel
    P holds one rank's heads: gather(sigma) gives every head's of the layer, head0 is P's first among them."""
    if delta <= 0:
        return P
    sigma = head_spread(P, cand)
    sigma = sigma if gather is None else gather(sigma)
    low = sigma.argsort(dim=-1, stable=True)[..., :delta]
    chosen = torch.zeros(sigma.shape, dtype=torch.bool, device=P.device).scatter(-1, low, True)
    return torch.where(chosen[:, head0:head0 + P.shape[1], None], P2, P)


def focus(I: Tensor, n: Tensor, layer: int) -> Tensor:
    """Eqs. 12 and 14: I_t (1 - n_t / (l + 1)); n_t = how many layers before l (0-based) kept t."""
    return I * (1 - n.to(I.dtype) / (layer + 1))


def best_slots(scores: Tensor, pos: Tensor, k: int) -> Tensor:
    """Bool mask [B, H, S] of the k best scores per head; among equal scores the newer position wins, exactly as
    cache.drop_to keeps slots (cache.drop_lowest)."""
    drop = drop_lowest(scores, pos, scores.shape[-1] - k)
    return torch.ones_like(scores, dtype=torch.bool).scatter(-1, drop, False)


def biased_scores(P: Tensor, focus_t: Tensor, cand: Tensor, pos: Tensor, lam: float, K: int,
                  pin_value: float) -> Tensor:
    """Eqs. 15-16: P' = P + lambda focus (focus broadcast over heads), then each head's own top K candidates by the
    unbiased P (per head) score pin_value (+inf; the paper's 1.0 can lose to P + lambda focus > 1).
    Non-candidates keep P's value (the window's +inf)."""
    out = P + lam * focus_t
    if K > 0:
        pinned = best_slots(P.masked_fill(~cand, -INF), pos, K) & cand
        out = out.masked_fill(pinned, pin_value)
    return out


def kept_any(pos: Tensor, length: int) -> Tensor:
    """Alg. 1 line 14: [B, length] int32, 1 at every position some head keeps in slot positions pos
    [B, H, n] (-1 = empty): a token kept by several heads counts once per layer (test T9)."""
    idx = torch.where(pos >= 0, pos, length).long().flatten(1)  # empty slots go to a dump column
    hit = torch.zeros(pos.shape[0], length + 1, dtype=torch.bool, device=pos.device).scatter(1, idx, True)
    return hit[:, :length].int()


@dataclass
class KVec(SnapKVPlusPlus):
    """K-VEC (section 4, Alg. 1), one-shot: after the dense prefill of layer l (attention first, so the prompt's own
    logits are untouched) each KV head keeps P = budget - max_new_tokens prompt tokens: the `window` latest plus the
    best P - window candidates by
        P'_t = P_t + lam I_t (1 - n_t / (l + 1)),   the head's top K = min(floor(beta P), P - window) by P pinned,
    where P_t is SnapKV's window score (Eq. 8: mean attention from the last obs_window queries, group mean),
    max-pooled along positions, except for the `delta` heads of LOWEST spread (population std over the candidates;
    the least focused, against Alg. 1's comment; ties to the lower head), which use the last long_window queries
    (Eq. 11); I_t is the per-token max over all query heads averaged over the obs_window queries, unpooled (Eq. 13);
    n_t counts the layers before l that kept t in any head (once per layer), read from a counter the engine keeps
    for the forward (`view.shared["n_cov"]`), updated after each layer. Pins score pin_value (+inf; the paper's
    literal 1.0 can lose to a biased score above 1). Means, not sums, over the queries that exist. A prompt that
    fits keeps everything and counts every token as kept. Ties keep the newer position (the engine's rule).
    New tokens are appended. lam = 0 with delta = 0 is SnapKV++ with window = obs_window and kernel 7."""
    name = "kvec"
    summary = "K-VEC: one-shot SnapKV + cross-head + cross-layer coverage bonus"
    lam: float = param(1.0, "weight of the cross-layer coverage bonus (0 = off)")
    delta: int = param(3, "KV heads per layer (lowest score spread) re-scored over the long window (0 = off)")
    beta: float = param(0.25, "share of the prompt slots each head pins by its own un-biased score")
    window: int = param(16, "latest prompt tokens always kept")
    obs_window: int = param(16, "observation window O of the score")
    long_window: int = param(32, "extended observation window O' of the least focused heads")
    kernel: int = param(7, "max-pool kernel along positions, odd (1 = off)")
    pin_value: float = param(INF, "score of pinned tokens (the paper's literal value is 1.0)")

    def validate(self):
        if not 0 <= self.lam < INF:
            raise PolicyError(f"kvec: lam must be finite and >= 0, got {self.lam}")
        check_positive(self, "delta", "window", least=0)
        if not 0 <= self.beta <= 1:
            raise PolicyError(f"kvec: beta must be in [0, 1], got {self.beta}")
        if self.obs_window < 1 or self.long_window < self.obs_window:
            raise PolicyError(f"kvec: need obs_window >= 1 and long_window >= obs_window, got {self.obs_window} and "
                              f"{self.long_window}")
        check_odd(self, "kernel")
        if not self.pin_value > 0:
            raise PolicyError(f"kvec: pin_value must be > 0, got {self.pin_value}")

    def plan(self, run):
        if self.prompt_keep(run) <= self.window:
            raise PolicyError(f"kvec: budget={run.budget} - max_new_tokens={run.max_new_tokens} must exceed the "
                              f"recent window ({self.window})")

    def ring_size(self):  # the query ring holds the last max(O, O') prompt queries
        return max(self.obs_window, self.long_window)

    def score(self, view):
        pos, newest, W = view.pos, view.newest, self.window
        ring_q, ring_pos = view.layer_state["ring_q"], view.layer_state["ring_pos"]
        A = view.attention(ring_q, ring_pos, group_mean=False)  # [B, H_kv, G, R, S], fp32
        # tensor parallel: a rank holds some of the layer's heads; the cross-head and coverage terms read them all
        P, P2, I = window_means(A, ring_pos, self.obs_window, self.long_window, lambda x: max_over_ranks(x, view))
        P, P2 = (pool_votes(x, pos, newest, W, self.kernel, "max") for x in (P, P2))  # window slots +inf
        cand = (pos >= 0) & (pos <= newest - W)
        P = cross_head(P, P2, cand, self.delta, lambda x: all_heads(x, view), view.head0)
        n_cov = view.shared.get("n_cov")
        if view.layer == 0 or n_cov is None:  # a new prompt: no layer has kept anything yet
            n_pos = int(pos.max()) + 1  # past every position held (an eager one-shot compression: a host read)
            n_cov = view.shared["n_cov"] = torch.zeros(pos.shape[0], n_pos, dtype=torch.int32, device=pos.device)
            view.shared["prompt"] = pos[:, 0] >= 0  # the scratch's slot s holds position s (or padding)
        n = n_cov.gather(1, pos.clamp_min(0).long().flatten(1)).view_as(pos)
        K = min(int(self.beta * view.keep), view.keep - W)
        scores = biased_scores(P, focus(I[:, None], n, view.layer), cand, pos, self.lam, K, self.pin_value)
        kept = best_slots(scores.masked_fill(pos < 0, -INF), pos, min(view.S, view.keep))  # as cache.drop_to keeps
        n_cov += max_over_ranks(kept_any(torch.where(kept, pos, -1), n_cov.shape[1]), view)  # kept by any head
        return scores


def kvec_coverage(shared: dict) -> Tensor:
    """K-VEC's coverage metric (paper Tables 6-7): the share of the prompt's positions kept by at least one head in
    at least one layer of the last one-shot prefill, [batch]."""
    return (shared["n_cov"] > 0).sum(-1) / shared["prompt"].sum(-1)


# ------------------------------------------------------------------------------------------------------ registry
REGISTRY = {p.name: p for p in [KeyDiff, Sink, TOVA, SnapKV, H2O, KeyNorm, RandomScores, *caote_policies(),
                                SnapKVPlusPlus, RocketKV, ExactTopK, SageKV, KVec]}


def parameters(cls) -> list:
    return list(dataclasses.fields(cls))


def type_name(tp) -> str:
    args = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
    return args[0].__name__ if isinstance(tp, types.UnionType) and args else tp.__name__


def parse_value(cls, f, text: str):
    """A parameter's value from its text, by the field's type."""
    tp = f.type
    if isinstance(tp, types.UnionType):  # X | None
        if text.lower() == "none":
            return None
        tp = next(a for a in tp.__args__ if a is not type(None))
    try:
        if tp is bool:
            low = text.lower()
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return low in ("true", "1", "yes", "on")
        return tp(text)
    except ValueError:
        raise PolicyError(f"{cls.name}: {f.name} takes {type_name(f.type)}, got {text!r}") from None


def split_spec(spec: str) -> tuple[str, str]:
    """`NAME:key=value,...` -> (NAME, "key=value,..."); names may hold a colon themselves (caote:h2o)."""
    spec = spec.strip()
    if spec in REGISTRY or spec == "full" or ":" not in spec:
        return spec, ""
    name, _, params = spec.rpartition(":")
    if "=" not in params and name not in REGISTRY and name != "full":  # e.g. caote:sink: a name
        return spec, ""
    return name, params


def spec_list(text: str) -> list[str]:
    """A comma list of policy specs; a policy's own key=value pairs stay with it: "full,snapkv:window=8,kernel=3"
    -> ["full", "snapkv:window=8,kernel=3"]."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        if "=" in x and ":" not in x and out:
            out[-1] += "," + x
        elif x:
            out.append(x)
    return out


def lookup(spec: str):
    """The policy class of a spec (None for full); an unknown name raises PolicyError."""
    name = split_spec(spec)[0]
    if name == "full":
        return None
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: full, {', '.join(REGISTRY)}")
    return REGISTRY[name]


def resolve(policy):
    """A policy from a spec string (make), a policy object or None (full); PolicyError naming anything else (a
    policy's class, a number)."""
    if isinstance(policy, str):
        return make(policy)
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy={policy!r} is not a spec string (\"keydiff\"), a policy object (an instance) or "
                          "None")
    return policy


def make(spec: str):
    """A policy from `NAME` or `NAME:key=value,key=value` (None for `full`); bad names, unknown parameters, malformed
    pairs and values out of range raise PolicyError with one line."""
    if spec.strip().endswith(":"):
        raise PolicyError(f"malformed policy {spec!r}: nothing after ':' (NAME:key=value,...)")
    name, params = split_spec(spec)
    cls = lookup(name)
    if cls is None:
        if params:
            raise PolicyError("policy full has no parameters")
        return None
    fields = {f.name: f for f in parameters(cls)}
    values = {}
    for pair in params.split(",") if params else []:
        key, eq, text = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PolicyError(f"malformed policy parameter {pair!r} in {spec!r}: expected key=value")
        if key not in fields:
            have = ", ".join(fields) or "none"
            raise PolicyError(f"policy {name} has no parameter {key!r} (its parameters: {have})")
        if key in values:
            raise PolicyError(f"policy parameter {key!r} given twice in {spec!r}")
        values[key] = parse_value(cls, fields[key], text.strip())
    return cls(**values)

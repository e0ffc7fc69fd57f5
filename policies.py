"""KV-cache policies: each scores the slots of one layer; cache.py keeps the `budget` best and moves them.

A policy's `score(cache, q, query_pos, S)` returns fp32 [batch, n_kv_heads, S] over the first S slots (the kept
tokens plus the block just written). Higher = keep, +inf = protected. Empty slots are set to -inf by cache.py.
Everything is a static-shaped tensor op so that a step compiles with fullgraph=True.
"""
import torch
from torch import Tensor


class PolicyError(ValueError):
    """An unknown policy or parameters that cannot work; the message is one line for the user."""


class Policy:
    name = ""
    help = ""

    def __init__(self, args=None):
        self.args = args

    def slot_state(self) -> dict:
        """Per-slot state: name -> (extra shape, dtype); cache.py allocates and moves it."""
        return {}

    def check(self, budget: int, block_size: int) -> None:
        """Raise PolicyError for parameters that cannot work with this budget and block size."""

    def score(self, cache, q: Tensor, query_pos: Tensor, S: int) -> Tensor:
        raise NotImplementedError


def recent_mask(slot_pos: Tensor, query_pos: Tensor, n_recent: int) -> Tensor:
    """Slots holding one of the `n_recent` latest positions seen so far (query_pos.max() is the newest)."""
    return slot_pos > query_pos.max() - n_recent


class RandomScores(Policy):
    """A seeded hash of (position, head): the floor every real policy must beat, and a neutral scorer for testing
    the cache mechanics. Static and deterministic (no RNG state), so compiled == eager."""
    name = "random"
    help = "seeded random eviction (--seed)"

    def score(self, cache, q, query_pos, S):
        seed = getattr(self.args, "seed", 0) if self.args is not None else 0
        pos = cache.pos[:, :, :S].double()
        head = torch.arange(pos.shape[1], device=pos.device, dtype=torch.float64)[None, :, None]
        x = torch.sin(pos * 12.9898 + head * 78.233 + seed * 37.719) * 43758.5453
        return (x - x.floor()).float()


REGISTRY = {p.name: p for p in [RandomScores]}


def describe() -> str:
    return "full (no eviction); " + "; ".join(f"{n} ({p.help})" for n, p in REGISTRY.items())


def lookup(name: str):
    """The policy class for `name`, None for full; unknown names raise a one-line error."""
    if name == "full":
        return None
    if name not in REGISTRY:
        raise PolicyError(f"unknown policy {name!r}; known: full, {', '.join(REGISTRY)}")
    return REGISTRY[name]

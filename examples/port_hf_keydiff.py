"""KeyDiff ported into HF transformers (docs/porting.md, "Porting into HF transformers"): a forward loop over a
DynamicCache, evicted in place after every prefill block and decode step, each layer and KV head keeping its own
positions, exactly budgetkv's `--policy keydiff --budget B --block-size 16`.

    python scripts/convert_hf_checkpoint.py --checkpoint smollm2-135m --to-hf /tmp/smollm2-hf
    python examples/port_hf_keydiff.py /tmp/smollm2-hf --budget 20 --prompt "The lighthouse keeper climbed the stairs"

The three things a port into HF must do itself: gather each KV head's own kept slots (DynamicCache holds one
[batch, heads, slots, head_dim] tensor per layer, so every head keeps `budget` slots, in its own order), track the
absolute position of every slot and pass `position_ids` (RoPE) apart from `cache_position` (the slot index the causal
mask compares with), and load weights HF can read (the --to-hf copy above).
"""
import argparse

import torch


def keydiff_scores(keys, pos, newest: int, budget: int, window_frac: float):
    """KeyDiff (docs/policies.md#keydiff): -cos(k_j, mean of the head's keys), the floor(window_frac x budget)
    newest positions protected (+inf). keys [B, H, S, D] post-RoPE, pos [B, H, S] their positions."""
    k = keys.float()
    norms = k.norm(dim=-1).clamp_min(1e-8)
    mu = k.mean(dim=2, keepdim=True)
    s = -(k @ mu.transpose(-1, -2))[..., 0] / (norms * mu.norm(dim=-1).clamp_min(1e-8))
    return s.masked_fill(pos > newest - int(window_frac * budget), float("inf"))


def evict(cache, pos: list, budget: int, newest: int, window_frac: float) -> None:
    """Keep the `budget` best slots of every layer and KV head (ties: the newer position), by a per-head gather of
    keys, values and positions; pos[i] [B, H, S] is layer i's slot positions, replaced in place."""
    for i, layer in enumerate(cache.layers):
        if layer.keys.shape[2] <= budget:
            continue
        scores = keydiff_scores(layer.keys, pos[i], newest, budget, window_frac)
        newest_first = pos[i].argsort(dim=-1, descending=True, stable=True)
        best = scores.gather(-1, newest_first).argsort(dim=-1, descending=True, stable=True)[..., :budget]
        keep = newest_first.gather(-1, best).sort(dim=-1).values  # [B, H, budget] slots, in slot order
        rows = keep[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, rows), layer.values.gather(2, rows)
        pos[i] = pos[i].gather(-1, keep)


@torch.inference_mode()
def generate(model, ids: list[int], new_tokens: int, budget: int, block_size: int = 16, window_frac: float = 0.2,
             on_step=None) -> list[int]:
    """Greedy generation with KeyDiff over a DynamicCache: the prompt in blocks of block_size, then each generated
    token as one step; on_step(pos) after each step's eviction (pos: every layer's [B, H, S] kept positions)."""
    from transformers import DynamicCache
    cache, pos = DynamicCache(config=model.config), []
    H = model.config.num_key_value_heads

    def step(tokens: list[int], start: int):
        T, S = len(tokens), cache.get_seq_length()
        logits = model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(start, start + T)[None],  # absolute positions: RoPE
                       cache_position=torch.arange(S, S + T)).logits  # slot indices: the causal mask
        new = torch.arange(start, start + T).expand(1, H, T)
        pos[:] = [torch.cat([p, new], -1) for p in pos] if pos else [new] * len(cache.layers)
        evict(cache, pos, budget, start + T - 1, window_frac)
        if on_step is not None:
            on_step(pos)
        return int(logits[0, -1].argmax())

    for start in range(0, len(ids), block_size):
        token = step(ids[start:start + block_size], start)
    out = []
    for n in range(new_tokens):
        out.append(token)
        token = step([token], len(ids) + n)
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir", help="an HF transformers folder (scripts/convert_hf_checkpoint.py --to-hf writes one)")
    ap.add_argument("--prompt", default="The lighthouse keeper climbed the narrow stairs every evening at dusk.")
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32).eval()
    ids = tok(a.prompt, add_special_tokens=False).input_ids
    print(tok.decode(generate(model, ids, a.new_tokens, a.budget)))


if __name__ == "__main__":
    main()

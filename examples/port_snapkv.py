"""SnapKV, ported from docs/policies.md#snapkv in plain NumPy: one-shot (the whole prompt is one step, then one
decode token per step) and block-wise, float32 and int8 KV.

    python examples/port_snapkv.py tests/vectors /tmp/snapkv && python scripts/check_port.py tests/vectors /tmp/snapkv
"""
import numpy as np

from port_common import attention, main


def score(ctx, h, cand, newest):
    """The last `window` queries seen (the ring: positions newest - window + 1 .. newest, every query head of the
    group) vote with their causal softmax attention over the candidates, summed over the queries and averaged over
    the group; the votes are average-pooled in position order (kernel, stride 1, zero padding counted); the window's
    own positions vote 0 and are protected (+inf)."""
    window, kernel = ctx["params"]["window"], ctx["params"]["kernel"]
    ring = np.arange(max(0, newest - window + 1), newest + 1)
    votes = attention(ctx, h, ring, cand).sum(0)  # an older query sees only the keys up to its position
    in_window = cand > newest - window
    votes = np.pad(np.where(in_window, 0.0, votes), kernel // 2)
    pooled = np.convolve(votes, np.ones(kernel), "valid") / kernel
    return np.where(in_window, np.inf, pooled)


if __name__ == "__main__":
    main("snapkv", score)

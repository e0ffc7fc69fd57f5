"""KeyDiff, ported from docs/policies.md#keydiff in plain NumPy: every keydiff case (block-wise, one-shot, int8).

    python examples/port_keydiff.py tests/vectors /tmp/keydiff && python scripts/check_port.py tests/vectors /tmp/keydiff
"""
import numpy as np

from port_common import main


def score(ctx, h, cand, newest):
    """-cos(k_j, mu), mu the mean of the head's raw keys over the candidates (kept + block), norms clamped at 1e-8;
    the floor(window_frac x budget) newest positions seen are protected (+inf)."""
    k = ctx["k"][cand, h]
    norms = np.maximum(np.linalg.norm(k, axis=-1), 1e-8)
    mu = (k / norms[:, None]).mean(0) if ctx["params"]["anchor"] == "normalized" else k.mean(0)
    s = -(k @ mu) / (norms * max(np.linalg.norm(mu), 1e-8))
    window = int(ctx["params"]["window_frac"] * ctx["budget"])
    return np.where(cand > newest - window, np.inf, s)


if __name__ == "__main__":
    main("keydiff", score)

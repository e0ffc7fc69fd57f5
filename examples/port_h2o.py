"""H2O, ported from docs/policies.md#h2o in plain NumPy: every h2o case (block-wise, one-shot, int8).

    python examples/port_h2o.py tests/vectors /tmp/h2o && python scripts/check_port.py tests/vectors /tmp/h2o
"""
import numpy as np

from port_common import attention, main


def score(ctx, h, cand, newest):
    """Each candidate's running sum of the attention it received since it entered (causal, group mean), the step's
    own queries (its block's; one-shot: every prompt query) added before scoring; a new position starts at 0. The
    floor(window_frac x budget) newest positions are protected (+inf)."""
    sums = ctx.setdefault("sums", {}).setdefault(h, {})
    total = np.array([sums.get(p, 0.0) for p in cand.tolist()], np.float32)
    total += attention(ctx, h, np.array(ctx["block"]), cand).sum(0)
    sums.clear()
    sums.update(zip(cand.tolist(), total))
    window = int(ctx["params"]["window_frac"] * ctx["budget"])
    return np.where(cand > newest - window, np.inf, total)


if __name__ == "__main__":
    main("h2o", score)

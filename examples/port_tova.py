"""TOVA, ported from docs/policies.md#tova in plain NumPy: every tova case (block-wise, one-shot, int8), with the
default parameters (`heads=group`, `keep_last=false`).

    python examples/port_tova.py tests/vectors /tmp/tova && python scripts/check_port.py tests/vectors /tmp/tova
"""
import numpy as np

from port_common import attention, main


def score(ctx, h, cand, newest):
    """The newest query's attention over the candidates (the block's last query; one-shot: the last prompt token's),
    averaged over the group; nothing protected, nothing accumulated."""
    return attention(ctx, h, np.array([newest]), cand)[0]


if __name__ == "__main__":
    main("tova", score)

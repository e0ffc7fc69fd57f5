"""scripts/bench_speculate.py end to end on tiny random-weight shapes (eager): one row per weight format, context,
draft policy, budget and K, each with plain decode's tokens (greedy identity), the acceptance, the measured and the
predicted speedup; the JSON and the plot are written; bad input is one line and exit 2."""
import json
import subprocess
import sys

import pytest
from conftest import REPO

from scripts import bench_speculate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_grid_end_to_end(tiny_config_dir, tmp_path, capsys):
    out, png = tmp_path / "spec.json", tmp_path / "spec.png"
    code = bench_speculate.main(["--checkpoint", str(tiny_config_dir), "--random-weights", "--policies",
                                 "sink,snapkv:window=8,rocketkv", "--budgets", "24,48", "--ks", "2,3", "--contexts",
                                 "60,90", "--weights", "float32,int8", "--new-tokens", "8", "--block-size", "16",
                                 "--threads", "1", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    rows = json.loads(out.read_text())["rows"]
    # rocketkv appends: budget 24 leaves too little of the prompt for its window (skipped, said so), 48 runs
    assert len(rows) == 2 * 2 * (2 + 2 + 1) * 2
    assert "rocketkv budget 24: skipped" in printed.err
    for x in rows:
        assert x["same_tokens"], x
        assert 0 <= x["accepted_per_round"] <= x["k"] and x["speedup"] > 0
        assert 0 < x["predicted_speedup"] <= x["best_case_speedup"] + 1e-9
    assert png.stat().st_size > 1000
    assert printed.out.count("\n| float32 |") + printed.out.count("\n| int8 |") == len(rows)


@pytest.mark.parametrize("extra,message", [
    (["--ks", "0"], "--ks needs integers >= 1"),
    (["--ks", "17"], "--ks: K must be between 1 and 16"),
    (["--policies", "full"], "full keeps every token"),
    (["--weights", "int4"], "unknown format 'int4'"),
    (["--contexts", "3000"], "exceed the model's context"),
])
def test_bad_input_one_line_exit_2(tiny_config_dir, capsys, extra, message):
    code = bench_speculate.main(["--checkpoint", str(tiny_config_dir), "--random-weights", *extra])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_bench_speculate_runs_as_a_script(tiny_config_dir):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_speculate.py"), "--checkpoint",
                        str(tiny_config_dir), "--random-weights", "--policies", "sink", "--budgets", "16", "--ks",
                        "2", "--contexts", "40", "--weights", "float32", "--new-tokens", "4", "--block-size", "8",
                        "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| float32 | 40 | sink | 16 | 2 |" in r.stdout


def test_a_difference_names_plains_top2_gap():
    import torch
    assert bench_speculate.top2_gap(torch.tensor([[1.0, 3.0, 2.5]])) == 0.5
    tie = torch.tensor([[30.0, 37.0, 37.05]]).to(torch.bfloat16)  # both round to 37.0 in bf16: a tie
    assert bench_speculate.top2_gap(tie) == 0.0 and int(tie.argmax(-1)) == 1  # argmax: the lower id
    row = dict(first_difference=4, plain_margin_at_difference=0.0)
    assert bench_speculate.difference(row) == "token 4 (plain's top-2 gap there 0)"

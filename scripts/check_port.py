"""Check a port of budgetkv's policies against the test vectors (docs/porting.md).

    python scripts/check_port.py VECTORS RESULTS [--case PATTERN]

VECTORS: the directory scripts/make_vectors.py wrote (tests/vectors). RESULTS: a directory holding, for each case the
port ran, CASE.safetensors with the case's outputs in the vectors' format: `kept` (required), `scores` and `selected`
(checked when present). Cases without a result file are skipped; at least one must be there.

Every step and head is compared until the head's kept set first differs (later steps start from other candidates);
a mismatch is reported once per case and cause with its first step: the positions that differ, the engine's scores
around the cut, and which part of the rule to look at. Exit 0: every checked case matches; 1: a mismatch; 2: bad
input (one line). Needs numpy and safetensors only.
"""
import argparse
import fnmatch
import json
import sys
from pathlib import Path

import numpy as np

RTOL, ATOL = 1e-4, 1e-6  # scores: float32 computed in another order by another engine


class BadInput(Exception):
    pass


def load(path: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise BadInput("needs the safetensors package (pip install safetensors numpy)") from None
    if not path.is_file():
        raise BadInput(f"{path}: no such file")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several kinds for a damaged or foreign file
        raise BadInput(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


def read_manifest(vectors: Path) -> dict:
    path = vectors / "manifest.json"
    if not path.is_file():
        raise BadInput(f"{vectors}: no manifest.json (give the directory scripts/make_vectors.py wrote)")
    try:
        manifest = json.loads(path.read_text())
        manifest["cases"][0]["case"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BadInput(f"{path}: not a test-vector manifest") from None
    return manifest


def step_name(steps: list, s: int, protocol: str, new_tokens: int) -> str:
    start, end = steps[s]
    where = f"position {start}" if end - start == 1 else f"positions {start}-{end - 1}"
    if s >= len(steps) - new_tokens:
        kind = "decode"
    else:
        kind = "one-shot prefill and compression" if protocol == "one-shot" else "prefill block"
    return f"step {s} ({kind}, {where})"


def fmt(positions) -> str:
    p = [int(x) for x in positions]
    return ", ".join(map(str, p[:6])) + (", ..." if len(p) > 6 else "")


def around_cut(score: np.ndarray, kept: np.ndarray) -> str:
    """The engine's candidates in the order it drops them (lowest score first, ties: older first), around the cut."""
    cand = np.flatnonzero(~np.isnan(score))
    if cand.size == 0:
        return ""
    order = cand[np.lexsort((cand, score[cand]))]
    n_drop = int((kept[order] == 0).sum())
    lo, hi = max(0, n_drop - 3), min(len(order), n_drop + 3)
    dropped = " ".join(f"{p}:{score[p]:.6g}" for p in order[lo:n_drop])
    kept_s = " ".join(f"{p}:{score[p]:.6g}" for p in order[n_drop:hi])
    return f"; engine's cut (position:score) dropped .. {dropped} | kept {kept_s} .."


def score_mismatch(score: np.ndarray, got: np.ndarray, block: range) -> tuple[str, str] | None:
    """(cause, detail) of the first score of one step and head that differs from the engine's, or None."""
    unscored = [p for p in block if not np.isnan(score[p]) and np.isnan(got[p])]
    if unscored:
        return "order", (f"the step's own tokens {fmt(unscored)} were not scored: write the step's block and attend "
                         "first, then score the kept slots plus the block and evict (attend before evict)")
    cand = ~np.isnan(score)
    bad = (cand & ~np.isclose(got, score, rtol=RTOL, atol=ATOL)) | (cand != ~np.isnan(got))
    if not bad.any():
        return None
    p = int(np.flatnonzero(bad)[0])
    what = f"position {p} scores {got[p]:.6g}, expected {score[p]:.6g}"
    if cand[p] and not np.isnan(got[p]) and (score[p] == np.inf) != (got[p] == np.inf):
        return "protected", f"{what}: check which positions the rule protects (+inf) and the window's boundary"
    if not cand[p]:
        return "scores", f"{what}: the candidates are the kept positions plus the step's block"
    return "scores", f"{what}: the first score that differs"


def diagnose(exp: np.ndarray, got: np.ndarray, score, got_score, block: range) -> tuple[str, str]:
    """(cause, one-line detail) of a kept-set mismatch of one step and head."""
    n_exp, n_got = int(exp.sum()), int(got.sum())
    if n_exp != n_got:
        return "count", (f"keeps {n_got} slots, expected {n_exp}: check what the budget counts and when a step "
                         f"evicts (valid slots > budget)")
    lost, extra = np.flatnonzero(exp > got), np.flatnonzero(got > exp)
    what = f"port dropped {fmt(lost)}, kept {fmt(extra)} instead"
    if score is None:
        return "kept", what + ": compare the rule's selection"
    found = score_mismatch(score, got_score, block) if got_score is not None else None
    if found is not None and found[0] == "order":
        return found[0], f"{what}; {found[1]}"
    inf_lost = [p for p in lost if score[p] == np.inf]
    if inf_lost:
        return "protected", (f"{what}; {fmt(inf_lost)} are protected (+inf) by the rule: check the window's "
                             "boundary and what it protects")
    for p in extra:
        newer = [c for c in np.flatnonzero(~np.isnan(score)) if c > p]
        if newer and all(score[c] == np.inf for c in newer):
            return "protected", (f"{what}; {p} is the newest position outside the protected window: the window "
                                 "is off by one (it holds floor(frac x budget) positions, the newest included)")
    for a in lost:
        for b in extra:
            if score[a] == score[b]:
                newer, older = max(a, b), min(a, b)
                return "tie", (f"{what}; positions {a} and {b} tie at {score[a]:.6g}: ties drop the older position "
                               f"({older}) and keep the newer ({newer})")
    if found is not None:
        return found[0], f"{what}; {found[1]}"
    return "kept", what + ": the ranking differs (compare the scores around the cut)"


def check_case(case: dict, exp: dict, got: dict, new_tokens: int) -> dict[str, str]:
    """{cause: first failure line} for one case."""
    steps, protocol = case["steps"], case["protocol"]
    for name in ("kept", "scores", "selected"):
        if name in got and name in exp and got[name].shape != exp[name].shape:
            raise BadInput(f"{case['case']}: {name} has shape {list(got[name].shape)}, expected "
                           f"{list(exp[name].shape)} [steps, heads, positions]")
    if "kept" not in got:
        raise BadInput(f"{case['case']}: the result has no `kept` tensor")
    for name in ("kept", "selected"):
        if name in got and not np.isin(got[name], (0, 1)).all():
            bad = got[name][~np.isin(got[name], (0, 1))].flat[0]
            raise BadInput(f"{case['case']}: {name} holds {bad}, but a mask holds only 0 and 1")
    if len(steps) != exp["kept"].shape[0]:
        raise BadInput(f"{case['case']}: the manifest lists {len(steps)} steps, its vectors {exp['kept'].shape[0]}")
    failures, counts = {}, {}

    def fail(cause, s, h, detail, head="head"):
        counts[cause] = counts.get(cause, 0) + 1
        if cause not in failures:
            failures[cause] = f"{step_name(steps, s, protocol, new_tokens)}, {head} {h}: {detail}"

    kept_e, kept_g = exp["kept"], got["kept"].astype(np.int64)
    sc_e, sc_g = exp.get("scores"), got.get("scores")
    diverged = set()  # heads whose kept set already differed: later steps start from other candidates
    for s in range(kept_e.shape[0]):
        block = range(*steps[s])
        for h in sorted(set(range(kept_e.shape[1])) - diverged):
            score = sc_e[s, h] if sc_e is not None else None
            if score is not None and np.isnan(score).all():
                score = None
            gs = sc_g[s, h].astype(np.float64) if sc_g is not None else None
            if not np.array_equal(kept_e[s, h], kept_g[s, h]):
                cause, detail = diagnose(kept_e[s, h], kept_g[s, h], score, gs, block)
                cut = around_cut(score, kept_e[s, h]) if score is not None else ""
                fail(cause, s, h, detail + cut)
                diverged.add(h)
            elif score is not None and gs is not None:
                found = score_mismatch(score, gs, block)
                if found is not None:
                    fail(found[0], s, h, f"same kept set, but {found[1]}")
        if "selected" in exp and "selected" in got:
            for h in range(exp["selected"].shape[1]):
                e, g = exp["selected"][s, h], got["selected"][s, h]
                if not np.array_equal(e > 0, g > 0):
                    fail("selection", s, h, f"attends {fmt(np.flatnonzero((g > 0) & (e == 0)))} instead of "
                                            f"{fmt(np.flatnonzero((e > 0) & (g == 0)))} (the decode-time selection)",
                         "selection head")
    return {c: f"{line} [{counts[c]} heads or steps]" if counts[c] > 1 else line for c, line in failures.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vectors", type=Path)
    ap.add_argument("results", type=Path)
    ap.add_argument("--case", default="*", help="only the cases whose name matches this glob")
    args = ap.parse_args(argv)
    try:
        manifest = read_manifest(args.vectors)
        if not args.results.is_dir():
            raise BadInput(f"{args.results}: not a directory (RESULTS holds CASE.safetensors files)")
        cases = [c for c in manifest["cases"] if fnmatch.fnmatchcase(c["case"], args.case)]
        if not cases:
            raise BadInput(f"--case {args.case!r} matches none of the manifest's {len(manifest['cases'])} case "
                           f"names (e.g. {manifest['cases'][0]['case']})")
        present = [c for c in cases if (args.results / f"{c['case']}.safetensors").is_file()]
        if not present:
            raise BadInput(f"{args.results}: no result for any of the {len(cases)} cases (CASE.safetensors, e.g. "
                           f"{cases[0]['case']}.safetensors)")
        bad = 0
        for case in present:
            exp = load(args.vectors / case["file"])
            got = load(args.results / f"{case['case']}.safetensors")
            failures = check_case(case, exp, got, manifest["shapes"][case["inputs"]]["new_tokens"])
            bad += bool(failures)
            for cause, line in failures.items():
                print(f"MISMATCH {case['case']} [{cause}] {line} (rule: {case['docs']})")
    except BadInput as e:
        print(f"check_port: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError, IndexError) as e:
        print(f"check_port: malformed vectors or results ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(f"{len(present) - bad} of {len(present)} cases match ({len(cases) - len(present)} without a result "
          f"skipped)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

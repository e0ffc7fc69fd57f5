"""Check a port of budgetkv's policies against the test vectors (docs/porting.md).

    python scripts/check_port.py VECTORS RESULTS [--case PATTERN]

VECTORS: the directory scripts/make_vectors.py wrote (tests/vectors). RESULTS: a directory holding, for each case the
port ran, CASE.safetensors with the case's outputs in the vectors' format: `kept` (required), `scores` and `selected`
(checked when present). Cases without a result file are skipped; at least one must be there.

Each head is compared step by step up to its first mismatch, which is reported and ends that head (its later steps
start from other candidates). A case prints one line per cause, at its first step: the positions that differ, the
engine's scores around the cut, and the cause, named only where the results show it (docs/porting.md lists them).
Scores: a step where the engine scored nothing (all NaN) is not compared; elsewhere NaN must meet NaN. Exit 0: every
checked case matches; 1: a mismatch; 2: bad input, one line per case (the other cases are still checked). Needs numpy
and safetensors only.
"""
import argparse
import fnmatch
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from files import read_json  # noqa: E402  (standard library only)

RTOL, ATOL = 1e-4, 1e-6  # scores: float32 computed in another order by another engine
LOOSE = 2e-3  # scores this close but not within RTOL: half-precision arithmetic
HALF_MAX = 65504.0  # float16's largest finite value


class BadInput(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        print(f"check_port: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


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
        manifest = read_json(path)
        cases = manifest["cases"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BadInput(f"{path}: not a test-vector manifest") from None
    if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) and isinstance(c.get("case"), str)
                                                           for c in cases):
        raise BadInput(f"{path}: not a test-vector manifest (\"cases\": a list of objects, each with a \"case\" "
                       "name)")
    return manifest


def fmt(positions) -> str:
    p = [int(x) for x in positions]
    return ", ".join(map(str, p[:6])) + (", ..." if len(p) > 6 else "")


class Case:
    """One case's manifest entry and shape, and the names the diagnosis uses."""

    def __init__(self, case: dict, shape: dict, mistakes: dict):
        self.name, self.steps, self.params, self.budget = case["case"], case["steps"], case["params"], case["budget"]
        self.protocol, self.policy, self.mistakes = case["protocol"], case["policy"], mistakes
        self.H, self.layers = shape["n_kv_heads"], shape.get("n_layers", 1)
        self.G, self.new_tokens = shape["n_heads"] // self.H, shape["new_tokens"]
        dup = {int(p): int(s) for p, s in shape.get("duplicates", {}).items()}
        self.token = lambda p: dup.get(p, p)  # positions holding the same key and value share a token

    def step(self, s: int) -> str:
        start, end = self.steps[s]
        where = f"position {start}" if end - start == 1 else f"positions {start}-{end - 1}"
        if s >= len(self.steps) - self.new_tokens:
            kind = "decode"
        else:
            kind = "one-shot prefill and compression" if self.protocol == "one-shot" else "prefill block"
        return f"step {s} ({kind}, {where})"

    def head(self, h: int, per: int, what: str = "head") -> str:
        return f"{what} {h}" if self.layers == 1 else f"layer {h // per}, {what} {h % per}"

    def window(self) -> str:
        """The policy's own parameter that protects positions, as this case sets it."""
        p = self.params
        if "window_frac" in p:
            return (f"{self.policy}'s window_frac x budget = floor({p['window_frac']} x {self.budget}) = "
                    f"{int(p['window_frac'] * self.budget)} newest positions")
        if "window" in p:
            return f"{self.policy}'s window = {p['window']} newest positions"
        if "n_sink" in p:
            return f"{self.policy}'s n_sink = {p['n_sink']} first positions"
        return f"the positions {self.policy} protects"


def around_cut(score: np.ndarray, kept: np.ndarray) -> str:
    """The engine's candidates in the order it drops them (lowest score first, ties: older first), around the cut."""
    cand = np.flatnonzero(~np.isnan(score))
    order = cand[np.lexsort((cand, score[cand]))]
    n_drop = int((kept[order] == 0).sum())
    lo, hi = max(0, n_drop - 3), min(len(order), n_drop + 3)
    dropped = " ".join(f"{p}:{score[p]:.6g}" for p in order[lo:n_drop])
    kept_s = " ".join(f"{p}:{score[p]:.6g}" for p in order[n_drop:hi])
    return f"; engine's cut (position:score) dropped .. {dropped} | kept {kept_s} .."


def protection(c: Case, score: np.ndarray, got: np.ndarray) -> tuple[str, str] | None:
    """Where the port's +inf (protected) positions differ from the engine's: one position off at the edge of the
    protected set is the window's boundary."""
    e, g = set(np.flatnonzero((score == np.inf) & ~np.isnan(got))), set(np.flatnonzero(got == np.inf))
    more, fewer = sorted(g - e), sorted(e - g)
    if not more and not fewer:
        return None
    off_by_one = None
    if len(more) + len(fewer) == 1:
        x = (more or fewer)[0]
        rest = e - {x}
        if rest and (x - 1 in rest or x + 1 in rest):
            how = "also protects" if more else "does not protect"
            off_by_one = f"the port {how} {x}: its protected window is one position too " \
                         f"{'wide' if more else 'narrow'} ({c.window()})"
    big = [p for p in more if abs(score[p]) > HALF_MAX]  # +inf: a float16 overflow
    overflow = big and f"the port's score of {big[0]} is +inf, the engine's {score[big[0]]:.6g}: past half " \
                       f"precision's largest value ({HALF_MAX:g}); compute the scores in float32"
    if off_by_one and overflow:  # the results cannot tell which
        return "protected", f"either {off_by_one}, or {overflow}"
    if off_by_one or overflow:
        return ("window", off_by_one) if off_by_one else ("precision", overflow)
    return "protected", (f"the port protects (+inf) {fmt(more) or 'nothing more'} and leaves {fmt(fewer) or 'nothing'}"
                         f" unprotected, against the engine ({c.window()})")


def score_structure(c: Case, score: np.ndarray, got: np.ndarray, block: range, evicted: bool) -> tuple | None:
    """(cause, detail) where one step's and head's scores differ from the engine's in which positions are scored
    or protected, or None. evicted: the port's kept set differs (it evicted otherwise)."""
    if np.isnan(got).all():
        if evicted or all(p in block for p in np.flatnonzero(~np.isnan(score))):
            return "order", ("the port scored none of the step's candidates (NaN), its own tokens included: write "
                             "the step's block and attend first, then score the kept positions plus the block and "
                             "evict (attend before evict)")
        return "scores", "the port recorded no score at this step; the engine scores every candidate here"
    cand = ~np.isnan(score)
    unscored = [p for p in block if cand[p] and np.isnan(got[p])]
    others = [p for p in np.flatnonzero(cand & ~np.isnan(got)) if p not in block]
    if unscored and others and len(unscored) == sum(cand[p] for p in block):
        return "order", (f"the step's own tokens {fmt(unscored)} were not scored: write the step's block and attend "
                         "first, then score the kept slots plus the block and evict (attend before evict)")
    return protection(c, score, got)


def score_values(c: Case, score: np.ndarray, got: np.ndarray) -> tuple[str, str] | None:
    """(cause, detail) of the first score of one step and head that differs from the engine's, or None."""
    cand = ~np.isnan(score)
    bad = (cand & ~np.isclose(got, score, rtol=RTOL, atol=ATOL)) | (cand != ~np.isnan(got))
    if not bad.any():
        return None
    p = int(np.flatnonzero(bad)[0])
    what = f"position {p} scores {got[p]:.6g}, expected {score[p]:.6g}"
    if not cand[p]:
        return "scores", f"{what}: the candidates are the kept positions plus the step's block"
    finite = cand & np.isfinite(score) & np.isfinite(got)
    if np.allclose(got[finite], score[finite], rtol=LOOSE, atol=ATOL):
        return "precision", (f"{what}: the scores agree to about 1e-3, not 1e-4: compute them in float32 (a "
                             "half-precision product or softmax)")
    for ratio in (c.G, 1 / c.G) if c.G > 1 else ():
        if np.allclose(got[finite], ratio * score[finite], rtol=RTOL, atol=ATOL):
            return "gqa", (f"{what}: the port's scores are {ratio:g} x the engine's: check how the group's "
                           f"{c.G} query heads combine (docs/porting.md: a mean, a sum for SnapKV++ and RocketKV)")
    return "scores", f"{what}: the first score that differs"


def known_mistake(c: Case, exp: dict, name: str, s: int, h: int, got: np.ndarray) -> tuple[str, str] | None:
    """The known mistake whose `name` tensor (kept or selected) equals the port's got[:s + 1, h], steps 0-s."""
    for m, why in c.mistakes.items():
        wrong = exp.get(f"mistake.{m}.{name}")
        if wrong is not None and np.array_equal(wrong[:s + 1, h], got[:s + 1, h]):
            return m, f"the port {'keeps' if name == 'kept' else 'selects'} what the engine does with {why}"
    return None


def diagnose(c: Case, exp: dict, s: int, h: int, kept: np.ndarray, score, got_score) -> tuple[str, str]:
    """(cause, one-line detail) of a kept-set mismatch at step s, head h (kept: the port's, every step and head)."""
    want, got, block = exp["kept"][s, h], kept[s, h], range(*c.steps[s])
    n_exp, n_got = int(want.sum()), int(got.sum())
    if n_exp != n_got:
        return "count", (f"keeps {n_got} slots, expected {n_exp}: check what the budget counts and when a step "
                         f"evicts (valid slots > budget)")
    lost, extra = np.flatnonzero(want > got), np.flatnonzero(got > want)
    what = f"port dropped {fmt(lost)}, kept {fmt(extra)} instead"
    both = score is not None and got_score is not None
    found = score_structure(c, score, got_score, block, True) if both else None
    if found is not None:
        return found[0], f"{what}; {found[1]}"
    if score is not None and got_score is None:
        dropped_block = [p for p in block if not np.isnan(score[p]) and want[p] == 0]
        if len(block) > 1 and dropped_block and all(got[p] > 0 for p in block):
            return "order", (f"{what}; the engine dropped the step's own {fmt(dropped_block)}, the port kept its "
                             "whole block: the block's tokens are candidates (attend before evict)")
        inf_lost = [p for p in lost if score[p] == np.inf]
        if inf_lost:
            return "protected", f"{what}; the rule protects (+inf) {fmt(inf_lost)} ({c.window()})"
    for a in lost:
        for b in extra:
            tied = score[a] == score[b] if score is not None else c.token(a) == c.token(b)
            if tied and (score is None or got_score is None or got_score[a] == got_score[b]):
                newer, older = max(a, b), min(a, b)
                how = f"tie at {score[a]:.6g}" if score is not None else "hold the same key and value"
                rule = (f"ties drop the older position ({older}) and keep the newer ({newer})" if score is not None
                        else f"a selection's tie takes the lower position ({older})")
                return "tie", f"{what}; positions {a} and {b} {how}: {rule}"
    known = known_mistake(c, exp, "kept", s, h, kept)
    if known is not None:
        return known[0], f"{what}; {known[1]}"
    found = score_values(c, score, got_score) if both else None
    if found is not None:
        return found[0], f"{what}; {found[1]}"
    near = [(a, b) for a in lost for b in extra if both and np.isclose(score[a], score[b], rtol=RTOL, atol=ATOL)]
    if near:
        a, b = near[0]
        return "precision", (f"{what}; the port's scores agree with the engine's to 1e-4, and {a} and {b} score "
                             f"{score[a]:.6g} and {score[b]:.6g}, closer than that: keep float32's range and order")
    if both:
        return "kept", f"{what}: the port's scores are the engine's, its choice is not (the budget's best by score)"
    return "kept", what + (": the ranking differs (compare the scores around the cut)" if score is not None else
                           ": compare the rule's selection")


def selection_mismatch(c: Case, exp: dict, s: int, h: int, selected: np.ndarray) -> tuple[str, str]:
    want, got = exp["selected"][s, h] > 0, selected[s, h] > 0
    more, fewer = np.flatnonzero(got & ~want), np.flatnonzero(want & ~got)
    what = "; ".join([f"attends {fmt(more)}, which the engine does not"] * bool(more.size) +
                     [f"does not attend {fmt(fewer)}"] * bool(fewer.size)) + " (the decode-time selection)"
    known = known_mistake(c, exp, "selected", s, h, (selected > 0).astype(exp["selected"].dtype))
    if known is not None:
        return known[0], f"{what}; {known[1]}"
    for a in fewer:
        for b in more:
            if c.token(a) == c.token(b):
                return "tie", (f"{what}; positions {a} and {b} hold the same key and value: a selection's tie "
                               f"takes the lower position ({min(a, b)})")
    return "selection", what


def check_shapes(c: Case, exp: dict, got: dict) -> None:
    if "kept" not in got:
        raise BadInput(f"{c.name}: the result has no `kept` tensor")
    for name in ("kept", "scores", "selected"):
        if name in got and name in exp and got[name].shape != exp[name].shape:
            raise BadInput(f"{c.name}: {name} has shape {list(got[name].shape)}, expected {list(exp[name].shape)} "
                           "[steps, heads, positions]")
    kept = got["kept"]
    ok = np.isfinite(kept) & (kept >= 0) & (kept <= c.G) & (kept == np.round(kept))
    if not ok.all():
        raise BadInput(f"{c.name}: kept holds {kept[~ok].flat[0]}, but a count is a whole number from 0 to {c.G} (a "
                       "position is held at most once per query head)")
    if "selected" in got and not np.isin(got["selected"], (0, 1)).all():
        bad = got["selected"][~np.isin(got["selected"], (0, 1))].flat[0]
        raise BadInput(f"{c.name}: selected holds {bad}, but a mask holds only 0 and 1")
    if len(c.steps) != exp["kept"].shape[0]:
        raise BadInput(f"{c.name}: the manifest lists {len(c.steps)} steps, its vectors {exp['kept'].shape[0]}")


def check_case(c: Case, exp: dict, got: dict) -> dict[str, str]:
    """{cause: first failure line} for one case."""
    check_shapes(c, exp, got)
    failures, counts, done = {}, {}, set()  # done: heads past their first mismatch

    def fail(cause, s, head, detail):
        counts[cause] = counts.get(cause, 0) + 1
        failures.setdefault(cause, f"{c.step(s)}, {head}: {detail}")

    kept_e, kept_g = exp["kept"], np.round(got["kept"]).astype(np.int64)
    sc_e, sc_g = exp.get("scores"), got.get("scores")
    sel_e, sel_g = exp.get("selected"), got.get("selected")
    n_sel = sel_e.shape[1] // c.layers if sel_e is not None else 0
    for s in range(kept_e.shape[0]):
        block = range(*c.steps[s])
        for h in sorted(set(range(kept_e.shape[1])) - done):
            score = sc_e[s, h] if sc_e is not None and not np.isnan(sc_e[s, h]).all() else None
            gs = sc_g[s, h].astype(np.float64) if sc_g is not None else None
            if not np.array_equal(kept_e[s, h], kept_g[s, h]):
                cause, detail = diagnose(c, exp, s, h, kept_g, score, gs)
                fail(cause, s, c.head(h, c.H), detail + (around_cut(score, kept_e[s, h]) if score is not None else ""))
                done.add(h)
            elif score is not None and gs is not None:
                found = score_structure(c, score, gs, block, False) or score_values(c, score, gs)
                if found is not None and found[0] == "scores":  # a known mistake may show in a later kept set
                    later = [t for t in range(s + 1, len(c.steps)) if not np.array_equal(kept_e[t, h], kept_g[t, h])]
                    known = known_mistake(c, exp, "kept", later[0], h, kept_g) if later else None
                    found = found if known is None else (known[0], f"{found[1]}; from step {later[0]} on, {known[1]}")
                if found is not None:
                    fail(found[0], s, c.head(h, c.H), f"same kept set, but {found[1]}")
                    done.add(h)
        if sel_e is not None and sel_g is not None:
            for h in range(sel_e.shape[1]):
                kv = h // n_sel * c.H + h % n_sel // (n_sel // c.H)
                if kv not in done and not np.array_equal(sel_e[s, h] > 0, sel_g[s, h] > 0):
                    cause, detail = selection_mismatch(c, exp, s, h, sel_g)
                    fail(cause, s, c.head(h, n_sel, "selection head"), detail)
                    done.add(kv)
    return {k: f"{line} [{counts[k]} heads]" if counts[k] > 1 else line for k, line in failures.items()}


def main(argv: list[str]) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("vectors", type=Path, help="the vectors' folder (tests/vectors)")
    ap.add_argument("results", type=Path, help="the port's results: one CASE.safetensors per case")
    ap.add_argument("--case", default="*", help="only the cases whose name matches this glob (default: *, every case)")
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
    except BadInput as e:
        print(f"check_port: {e}", file=sys.stderr)
        return 2
    bad = unreadable = 0
    for case in present:
        try:
            c = Case(case, manifest["shapes"][case["inputs"]], manifest.get("mistakes", {}))
            failures = check_case(c, load(args.vectors / case["file"]),
                                  load(args.results / f"{case['case']}.safetensors"))
        except BadInput as e:
            print(f"check_port: {e}", file=sys.stderr)
            unreadable += 1
            continue
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, ArithmeticError) as e:
            print(f"check_port: {case.get('case')}: malformed vectors or results ({type(e).__name__}: {e})",
                  file=sys.stderr)
            unreadable += 1
            continue
        bad += bool(failures)
        for cause, line in failures.items():
            print(f"MISMATCH {case['case']} [{cause}] {line} (rule: {case['docs']})")
    checked = len(present) - unreadable
    print(f"{checked - bad} of {checked} checked cases match ({len(cases) - len(present)} without a result skipped"
          + (f", {unreadable} with bad input" if unreadable else "") + ")")
    if bad:
        print(f"check_port: {bad} of {checked} checked cases do not match (the MISMATCH lines say where)",
              file=sys.stderr)
    return 2 if unreadable else 1 if bad else 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
        sys.stdout.flush()
    except OSError as e:  # the report cannot be written (a closed pipe, a full disk): one line, not a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"check_port: cannot write the report to standard output: {e.strerror or e}", file=sys.stderr)
        code = 1
    sys.exit(code)

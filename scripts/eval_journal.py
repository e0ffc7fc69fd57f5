"""scripts/eval.py's journal, results.jsonl: one line per finished configuration, under a header of the settings the
results depend on, so that --resume runs only what is missing and refuses a journal written with other settings."""
import sys

if __name__ == "__main__":  # run directly: one line, not an ImportError
    PART = "scripts/eval_journal.py is a part of scripts/eval.py, not a command of its own"
    print(f"usage: {PART}" if sys.argv[1:] in (["-h"], ["--help"]) else f"error: {PART}",
          file=sys.stdout if sys.argv[1:] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import math
from pathlib import Path

import torch

from errors import UserError
from scripts.eval_report import measures
from scripts.outputs import check_settings, checkpoint_identity, checksum, digest, read_lines


JOURNAL = "results.jsonl"
# vars(a) that are not settings: the configurations themselves, what is identified by content instead (the
# checkpoint, LongBench's files: by the prompts' hash), and what has no bearing on the results
NOT_SETTINGS = {"policies", "budgets", "prefill", "tasks", "longbench", "checkpoint", "longbench_source", "out_dir",
                "threads", "quick", "resume"}
ENTRY = {"run": str, "task": str, "protocol": str, "policy": str, "budget": (int, type(None)), "data": str,
         "records": list, "na": (str, type(None))}


def run_settings(a, ckpt, dtype) -> dict:
    """What the results of every configuration depend on besides the configuration itself: the journal's header."""
    return {k: v for k, v in vars(a).items() if k not in NOT_SETTINGS} | dict(
        checkpoint=checkpoint_identity(ckpt), dtype=str(dtype), torch=torch.__version__)


def read_journal(path: Path, settings: dict) -> dict:
    """--resume: the configurations `path` holds from a run with these settings, by (task, protocol, policy,
    budget, prompts' hash); a journal written with other settings is refused."""
    if not path.exists():
        print(f"--resume: no {path} yet: running every configuration", file=sys.stderr)
        return {}
    lines = read_lines(path)
    if not lines:
        return {}
    head = lines[0][1]
    check_settings(path, head.get("settings") if isinstance(head, dict) else None, settings)
    done, run_id = {}, digest(settings)
    for n, e in lines[1:]:
        bad = next((f"{k} is missing or of the wrong type" for k, kind in ENTRY.items()
                    if not isinstance(e.get(k), kind)), None) if isinstance(e, dict) else "not a JSON object"
        if bad is None and not all(isinstance(r, dict) and r.get("task") == e["task"] and all(
                isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in measures(e["task"]))
                for r in e["records"]):
            bad = "a record is malformed or holds a measure that is not a finite number"
        stray = next((r for r in e["records"] if any(r.get(k) != e[k] for k in ("protocol", "policy", "budget"))),
                     None) if bad is None else None
        if stray is not None:
            bad = (f"a record of {stray.get('policy')} ({stray.get('protocol')}, budget {stray.get('budget')}) under "
                   f"{e['policy']} ({e['protocol']}, budget {e['budget']})")
        if bad is None and not e["records"] and e["na"] is None:
            bad = "no records, and not marked n/a"
        if bad is not None:
            raise UserError(f"--resume: {path} line {n}: {bad} (run without --resume to replace the file)")
        if e.get("sum") != checksum(e):  # edited by hand, or an older line
            print(f"--resume: {path} line {n}: its content does not match its checksum: measuring "
                  f"{e['policy']} ({e['task']}, budget {e['budget']}) again", file=sys.stderr)
        elif e["run"] == run_id:  # (another run's line only where two runs wrote at once)
            done[e["task"], e["protocol"], e["policy"], e["budget"], e["data"]] = e
    return done


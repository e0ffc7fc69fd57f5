"""Bad input to scripts/eval.py (its flags, and LongBench rows read by scripts/eval_tasks.py), scripts/bench.py,
scripts/bench_kvpress.py and scripts/bench_llamacpp.py (checked before it imports llama_cpp): one line on stderr naming the flag, file or row, the exit code of bad input (2), no
traceback, nothing loaded, and no file written or changed. A new flag's bad values go into CASES.

Each case: (argv, files, exit code, substring of the one line). argv[0] names the script; its BASE arguments (a tiny
checkpoint, small sizes) come first, so a case overrides them. `files` are created in the case's folder first
(a name ending in "/" is a folder, in "|" a named pipe); "{tmp}" in argv is that folder and "{ckpt}" the tiny checkpoint. Runs in this
process (no interpreter start per case); a case that would load a model or start a configuration fails."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from scripts import (bench, bench_batch, bench_figure, bench_kvpress, bench_llamacpp, bench_paired, bench_quant,
                     benchlib)
from scripts import eval as ev
from scripts import frontier
from conftest import REPO

BASE = {
    "eval.py": ["--checkpoint", "{ckpt}", "--out-dir", "{tmp}/out", "--tasks", "passkey", "--policies", "sink",
                "--budgets", "32", "--lengths", "200", "--fid-prefix", "64", "--fid-tokens", "8", "--block-size", "16",
                "--max-new-tokens", "4", "--device", "cpu"],
    "bench.py": ["--checkpoint", "{ckpt}", "--decode-steps", "8", "--device", "cpu"],
    "bench_quant.py": ["--checkpoint", "{ckpt}", "--decode-steps", "8", "--device", "cpu"],
    "bench_paired.py": ["--checkpoint", "{ckpt}", "--decode-steps", "8", "--device", "cpu"],
    "bench_batch.py": ["--checkpoint", "{ckpt}", "--decode-steps", "8", "--device", "cpu"],
    "bench_figure.py": ["--checkpoint", "{ckpt}", "--decode-steps", "8", "--device", "cpu", "--contexts", "64",
                        "--budgets", "16", "--out-dir", "{tmp}/fig"],
    "bench_kvpress.py": ["--model", "{tmp}/hf", "--press", "none", "--budget", "8", "--ids-file", "{tmp}/ids.json"],
    "bench_llamacpp.py": ["--ids-file", "{tmp}/ids.json"],
    "frontier.py": ["--checkpoint", "{ckpt}", "--out-dir", "{tmp}/out", "--length", "300", "--budgets", "32",
                    "--policies", "sink", "--fid-tokens", "8", "--block-size", "16", "--decode-steps", "4",
                    "--device", "cpu", "--eager"],
}
GGUF = {"m.gguf": b"GGUF" + bytes(28), "ids.json": "[1, 2]"}  # bench_llamacpp.py: passes the checks before llama.cpp
LB = ["--tasks", "", "--longbench", "hotpotqa", "--longbench-source", "{tmp}/lb.jsonl"]  # eval.py: one LongBench file
SMALL = ["--prompt-tokens", "100"]  # bench.py: a prompt the tiny model's context holds
BENCH = {"bench.py": bench, "bench_quant.py": bench_quant, "bench_paired.py": bench_paired,
         "bench_batch.py": bench_batch, "bench_figure.py": bench_figure}  # the scripts whose main() reads sys.argv
DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested 100,000 levels deep: files.read_json's bound, not a RecursionError
GOOD = {"input": "Who jumps?", "context": "The quick brown fox jumps.", "answers": ["the fox"], "all_classes": None}


def row(**change) -> str:
    """A LongBench row with fields changed (None: removed) as one JSON line."""
    r = {k: v for k, v in (GOOD | change).items() if v is not None or k not in change}
    return json.dumps(r) + "\n"


def lb(text, *extra):  # eval.py on a LongBench file holding `text`
    return (["eval.py", *LB, *extra], {"lb.jsonl": text})


CASES = [
    # ---- eval.py: flags
    (["eval.py", "--budgets", "32,abc"], {}, 2, "invalid comma-separated int value: '32,abc'"),
    (["eval.py", "--budgets", ""], {}, 2, "--budgets is empty"),
    (["eval.py", "--budgets", ",,"], {}, 2, "--budgets is empty"),
    (["eval.py", "--budgets", "0"], {}, 2, "--budgets must all be >= 1"),
    (["eval.py", "--budgets", "-5"], {}, 2, "--budgets must all be >= 1"),
    (["eval.py", "--budgets", "32,32"], {}, 2, "--budgets lists 32 twice"),
    (["eval.py", "--budgets", "4096"], {}, 2, "--budgets 4096 is larger than the model's context (2048)"),
    (["eval.py", "--budgets", "1e3"], {}, 2, "invalid comma-separated int value"),
    (["eval.py", "--lengths", "0"], {}, 2, "--lengths must all be >= 1"),
    (["eval.py", "--lengths", "200,200"], {}, 2, "--lengths lists 200 twice"),
    (["eval.py", "--lengths", "5000"], {}, 2, "--lengths 5000 leaves no room for an answer"),
    (["eval.py", "--lengths", "10"], {}, 2, "passkey at --lengths 10"),
    (["eval.py", "--depths", "1.5"], {}, 2, "--depths must be in [0, 1]"),
    (["eval.py", "--depths", "nan"], {}, 2, "--depths must be in [0, 1]"),
    (["eval.py", "--depths", "0,0"], {}, 2, "--depths lists 0.0 twice"),
    (["eval.py", "--depths", "x"], {}, 2, "invalid comma-separated float value"),
    (["eval.py", "--samples", "0"], {}, 2, "--samples must be >= 1"),
    (["eval.py", "--samples", "two"], {}, 2, "invalid int value: 'two'"),
    (["eval.py", "--block-size", "0"], {}, 2, "--block-size must be >= 1"),
    (["eval.py", "--block-size", "100000"], {}, 2, "--block-size 100000 is larger than the model's context (2048)"),
    (["eval.py", "--fid-prefix", "0"], {}, 2, "--fid-prefix must be >= 1"),
    (["eval.py", "--fid-tokens", "-1"], {}, 2, "--fid-tokens must be >= 1"),
    (["eval.py", "--fid-texts", "0"], {}, 2, "--fid-texts must be >= 1"),
    (["eval.py", "--tasks", "fidelity", "--fid-prefix", "2000", "--fid-tokens", "100"], {}, 2,
     "--fid-prefix + --fid-tokens exceeds the model's context (2048)"),
    (["eval.py", "--tasks", "nope"], {}, 2, "unknown task 'nope'"),
    (["eval.py", "--tasks", "fidelity,fidelity"], {}, 2, "--tasks lists fidelity twice"),
    (["eval.py", "--tasks", ""], {}, 2, "nothing to run: give --tasks or --longbench"),
    (["eval.py", "--prefill", "both"], {}, 2, "unknown --prefill 'both'"),
    (["eval.py", "--prefill", ""], {}, 2, "--prefill is empty"),
    (["eval.py", "--prefill", "block,block"], {}, 2, "--prefill lists block twice"),
    (["eval.py", "--policies", "nope"], {}, 2, "unknown policy 'nope'"),
    (["eval.py", "--policies", ""], {}, 2, "--policies is empty"),
    (["eval.py", "--policies", "sink:nope=1"], {}, 2, "nope"),
    (["eval.py", "--policies", "snapkv", "--budgets", "16"], {}, 2, "observation window"),
    (["eval.py", "--max-new-tokens", "-1"], {}, 2, "--max-new-tokens"),
    (["eval.py", "--threads", "-1"], {}, 2, "--threads"),
    (["eval.py", "--device", "mps"], {}, 2, "--device 'mps' is not a device: cpu, cuda or cuda:N"),
    (["eval.py", "--device", "cpu:1"], {}, 2, "--device 'cpu:1'"),
    (["eval.py", "--device", "cuda:7"], {}, 2, "--device cuda"),
    (["eval.py", "--dtype", "int8"], {}, 2, "invalid choice: 'int8'"),
    (["eval.py", "--checkpoint", "no-such-model"], {}, 2, "unknown checkpoint 'no-such-model'"),
    (["eval.py", "--checkpoint", "{tmp}/empty"], {"empty/": None}, 2, "has no config.json"),
    (["eval.py", "--checkpoint", "{tmp}/bad"], {"bad/config.json": "{"}, 2, "config.json is not valid JSON"),
    (["eval.py", "--out-dir", "/proc/no-such-dir"], {}, 2, "--out-dir /proc/no-such-dir"),
    (["eval.py", "--out-dir", "{tmp}/a-file"], {"a-file": "x"}, 2, "a-file: File exists"),
    (["eval.py", "--longbench", "nope"], {}, 2, "unknown LongBench task 'nope'"),
    (["eval.py", "--longbench", "hotpotqa,hotpotqa"], {}, 2, "--longbench lists hotpotqa twice"),
    (["eval.py", "--longbench-source", "{tmp}/lb.jsonl"], {"lb.jsonl": row()}, 2, "apply to --longbench tasks"),
    (["eval.py", "--longbench-limit", "3"], {}, 2, "apply to --longbench tasks"),
    (["eval.py", *LB, "--longbench", "en16"], {"lb.jsonl": row()}, 2, "lb.jsonl is one file, for 16 tasks"),
    (["eval.py", *LB, "--longbench-source", "{tmp}/missing.jsonl"], {}, 2, "missing.jsonl: no such file or folder"),
    (["eval.py", *LB, "--longbench-max-tokens", "-1"], {"lb.jsonl": row()}, 2, "--longbench-max-tokens"),
    (["eval.py", "--samples", "99999999999999999999"], {}, 2, "--samples must be at most 10000"),
    (["eval.py", "--tasks", "fidelity", "--fid-texts", "10001"], {}, 2, "--fid-texts must be at most 10000"),
    (["eval.py", "--out-dir", "{tmp}/o"], {"o/results.jsonl|": None}, 2, "results.jsonl: cannot write there (not a "
     "regular file"),
    (["eval.py", *LB, "--longbench-source", "{tmp}/p.jsonl"], {"p.jsonl|": None}, 2, "p.jsonl has no rows"),
    (["eval.py", *LB, "--longbench-source", "/dev/zero"], {}, 2, "/dev/zero is larger than 256 MiB"),
    # ---- eval.py --resume: an output it did not write, or wrote with other settings
    (["eval.py", "--resume"], {"out/results.jsonl": "not json\n"}, 2, "results.jsonl line 1 is not JSON"),
    (["eval.py", "--resume"], {"out/results.jsonl": b"\xff\xfe\n"}, 2, "results.jsonl is not UTF-8 text"),
    (["eval.py", "--resume"], {"out/results.jsonl": "[1, 2]\n"}, 2, "results.jsonl records no settings"),
    (["eval.py", "--resume"], {"out/results.jsonl": '{"settings": {"seed": 5}}\n'}, 2, "with other settings"),
    (["eval.py", "--resume"], {"out/results.jsonl/": None}, 2, "results.jsonl: cannot write there"),
    (["eval.py", "--resume"], {"out/results.jsonl": DEEP + "\n"}, 2, "line 1 is not JSON (nested deeper than 64 levels)"),
    (*lb(DEEP + "\n"), 2, "lb.jsonl line 1 is not JSON (nested deeper than 64 levels)"),
    (["bench.py", *SMALL, "--resume", "--json", "{tmp}/b.json"], {"b.json": DEEP}, 2,
     "b.json is not JSON (nested deeper than 64 levels)"),
    (["bench_figure.py", "--resume"], {"fig/rocketkv_figure.json": DEEP}, 2, "nested deeper than 64 levels"),
    (["bench_kvpress.py"], {"ids.json": DEEP}, 2, "ids.json is not JSON (nested deeper than 64 levels)"),
    (["bench_llamacpp.py"], {"ids.json": DEEP}, 2, "ids.json is not JSON (nested deeper than 64 levels)"),
    # ---- LongBench rows (scripts/eval_tasks.load_longbench, through eval.py)
    (*lb(""), 2, "lb.jsonl has no rows"),
    (*lb("\n  \n\n"), 2, "lb.jsonl has no rows"),
    (*lb("not json\n"), 2, "lb.jsonl line 1 is not JSON"),
    (*lb('{"context": "a"\n'), 2, "lb.jsonl line 1 is not JSON"),
    (*lb(row() + "{oops\n", "--longbench-limit", "5"), 2, "lb.jsonl line 2 is not JSON"),
    (*lb("\n" + row() + "[1]\n", "--longbench-limit", "5"), 2, "lb.jsonl line 3: a row is a JSON object, not a list"),
    (*lb('"just a string"\n'), 2, "a row is a JSON object, not a string"),
    (*lb("null\n"), 2, "a row is a JSON object, not null"),
    (*lb(row(context=None)), 2, "lb.jsonl line 1: 'context' must be a string, got nothing"),
    (*lb(row(context=5)), 2, "'context' must be a string, got a number"),
    (*lb(row(input=None)), 2, "'input' must be a string, got nothing"),
    (*lb(row(input=["a"])), 2, "'input' must be a string, got a list"),
    (*lb(row(answers="the fox")), 2, "'answers' must be a non-empty list of strings, got a string"),
    (*lb(row(answers=[])), 2, "'answers' must be a non-empty list of strings, got an empty list"),
    (*lb(row(answers=[1])), 2, "got a list holding a number"),
    (*lb(row(answers=None)), 2, "'answers' must be a non-empty list of strings, got nothing"),
    (*lb(row(answers={"a": 1})), 2, "got an object"),
    (*lb(row(all_classes="Date")), 2, "'all_classes' must be a non-empty list of strings, got a string"),
    (*lb(row(all_classes=[True])), 2, "got a list holding true/false"),
    (*lb(row().encode("utf-16")), 2, "lb.jsonl is not UTF-8 text"),
    (*lb(b'{"context": "\xff"}\n'), 2, "lb.jsonl is not UTF-8 text"),
    (["eval.py", *LB, "--longbench-source", "{tmp}/lbdir"], {"lbdir/trec.jsonl": row()}, 2,
     "lbdir/hotpotqa.jsonl: No such file or directory"),
    (["eval.py", *LB, "--longbench-source", "{tmp}/lbdir"], {"lbdir/hotpotqa.jsonl/": None}, 2,
     "hotpotqa.jsonl: Is a directory"),
    # ---- bench.py
    (["bench.py", "--budget", "abc"], {}, 2, "invalid int value: 'abc'"),
    (["bench.py", "--budget", "0"], {}, 2, "--budget must be >= 1"),
    (["bench.py", "--prompt-tokens", "0"], {}, 2, "--prompt-tokens must be >= 1"),
    (["bench.py", "--repeats", "0"], {}, 2, "--repeats must be >= 1"),
    (["bench.py", "--repeats", "99999999999999999999"], {}, 2, "--repeats must be at most 1000"),
    (["bench_quant.py", "--repeats", "1001"], {}, 2, "--repeats must be at most 1000"),
    (["eval.py", "--max-new-tokens", "99999999999999999999"], {}, 2,
     "--max-new-tokens 99999999999999999999 leaves no room for a prompt in the model's context (2048)"),
    (["bench.py", "--decode-steps", "1"], {}, 2, "--decode-steps must be >= 2"),
    (["bench.py", "--block-size", "0"], {}, 2, "--block-size must be >= 1"),
    (["bench.py", *SMALL, "--block-size", "4096"], {}, 2, "--block-size 4096 is larger than the model's context"),
    (["bench_figure.py", "--block-size", "4096"], {}, 2, "--block-size 4096 is larger than the model's context"),
    (["bench.py", "--threads", "0"], {}, 2, "--threads must be between 1 and 1024"),
    (["bench.py", "--threads", "100000"], {}, 2, "--threads must be between 1 and 1024"),
    (["bench.py", "--policies", "nope"], {}, 2, "unknown policy 'nope'"),
    (["bench.py", "--policies", "sink,sink"], {}, 2, "--policies lists sink twice"),
    (["bench.py", *SMALL, "--policies", "sink", "--budget", "2"], {}, 2, "must exceed the 4 sink"),
    (["bench.py", "--prompt-tokens", "5000"], {}, 2, "must fit the model's context (2048)"),
    (["bench.py", "--device", "xla"], {}, 2, "--device 'xla'"),
    (["bench.py", "--checkpoint", "no-such-model"], {}, 2, "unknown checkpoint 'no-such-model'"),
    (["bench.py", "--paired"], {}, 2, "unrecognized arguments: --paired"),
    (["bench.py", "--figure", "rocketkv"], {}, 2, "unrecognized arguments: --figure rocketkv"),
    (["bench_quant.py", "--modes", "int3"], {}, 2, "unknown --modes entry 'int3'"),
    (["bench_quant.py", "--modes", "int4-g0"], {}, 2, "unknown --modes entry 'int4-g0'"),
    (["bench_quant.py", "--modes", ","], {}, 2, "--modes is empty"),
    (["bench_quant.py", "--modes", "int8,int8"], {}, 2, "--modes lists int8 twice"),
    (["bench_quant.py", "--modes", "int8", "--ppl-texts", "0"], {}, 2, "--ppl-texts, --ppl-prefix and --ppl-tokens"),
    (["bench.py", "--ppl-texts", "2"], {}, 2, "unrecognized arguments: --ppl-texts"),
    (["bench.py", "--contexts", "1024"], {}, 2, "unrecognized arguments: --contexts 1024"),
    (["bench_figure.py", "--contexts", "abc"], {}, 2, "--contexts takes comma-separated integers"),
    (["bench_figure.py", "--contexts", "0"], {}, 2, "--contexts needs integers >= 1"),
    (["bench_figure.py", "--budgets", ""], {}, 2, "--budgets needs integers >= 1"),
    (["bench_figure.py", "--budgets", "16,16"], {}, 2, "--budgets lists 16 twice"),
    (["bench_figure.py", "--contexts", "4096"], {}, 2, "exceed the model's context (2048)"),
    (["bench_figure.py", "--out-dir", "/proc/x"], {}, 2, "--out-dir /proc/x"),
    (["bench_figure.py", "--json", "{tmp}/x.json"], {}, 2, "unrecognized arguments: --json"),
    (["bench_figure.py", "--policies", "sink"], {}, 2, "unrecognized arguments: --policies sink"),
    (["bench_paired.py", "--kvpress"], {}, 2, "unrecognized arguments: --kvpress"),
    (["bench.py", "--kvpress"], {}, 2, "--kvpress runs smollm2-135m's HF copy"),
    (["bench_paired.py", "--llamacpp"], {}, 2, "unrecognized arguments: --llamacpp"),
    (["bench_quant.py", "--llamacpp"], {}, 2, "unrecognized arguments: --llamacpp"),
    (["bench.py", "--compile-mode", "default"], {}, 2, "--compile-mode needs --compile"),
    (["bench.py", "--compile", "--compile-mode", "fast"], {}, 2, "invalid choice: 'fast'"),
    (["bench_paired.py", "--cpp-wrapper"], {}, 2, "--cpp-wrapper needs --compile"),
    (["bench_paired.py", "--freeze"], {}, 2, "--freeze needs --compile"),
    (["bench.py", "--freeze"], {}, 2, "unrecognized arguments: --freeze"),
    (["bench.py", "--no-compile-prefill"], {}, 2, "--no-compile-prefill needs --compile"),
    (["bench.py", "--profile"], {}, 2, "unrecognized arguments: --profile"),
    (["bench_paired.py", "--profile", "0"], {}, 2, "--profile needs >= 1 rows"),
    (["bench.py", "--json", "/proc/x.json"], {}, 2, "--json /proc/x.json: cannot write"),
    (["bench.py", "--json", "{tmp}/no-dir/x.json"], {}, 2, "x.json: cannot write there (No such file or directory)"),
    (["bench.py", "--json", "{tmp}/d"], {"d/": None}, 2, "cannot write there (Is a directory)"),
    (["bench_figure.py", "--one", "x"], {}, 2, "--one 'x'"),
    (["bench.py", "--json", "{tmp}/p"], {"p|": None}, 2, "--json {tmp}/p: cannot write there (not a regular file"),
    (["bench.py", "--json", "/dev/null"], {}, 2, "--json /dev/null: cannot write there (not a regular file"),
    (["bench_quant.py", "--json", "{tmp}/p", "--resume"], {"p|": None}, 2, "cannot write there (not a regular"),
    (["bench_batch.py", "--plot", "/dev/null"], {}, 2, "--plot /dev/null: cannot write there (not a regular"),
    (["bench_quant.py", "--ppl-texts", "10001"], {}, 2, "--ppl-texts must be at most 10000"),
    (["bench_quant.py", *SMALL, "--modes", "int8", "--ppl-prefix", "99999999999999999999"], {}, 2,
     "--ppl-prefix + --ppl-tokens (99999999999999999999 + 128) must fit the model's context (2048)"),
    (["bench_quant.py", "--one", "int3"], {}, 2, "unknown --modes entry 'int3'"),
    # ---- bench_batch.py
    (["bench_batch.py", "--paired"], {}, 2, "unrecognized arguments: --paired"),
    (["bench_batch.py", "--figure", "rocketkv"], {}, 2, "unrecognized arguments: --figure rocketkv"),
    (["bench_batch.py", "--quant", "int8"], {}, 2, "unrecognized arguments: --quant int8"),
    (["bench_batch.py", "--kvpress"], {}, 2, "unrecognized arguments: --kvpress"),
    (["bench_batch.py", "--resume", "--json", "{tmp}/b.json"], {}, 2, "unrecognized arguments: --resume"),
    (["bench.py", "--memory-cap", "100"], {}, 2, "unrecognized arguments: --memory-cap 100"),
    (["bench.py", "--batch-sizes", "1,2"], {}, 2, "unrecognized arguments: --batch-sizes 1,2"),
    (["bench.py", "--plot", "{tmp}/p.png"], {}, 2, "unrecognized arguments: --plot"),
    (["bench_batch.py", "--batch-sizes", "0,2"], {}, 2, "--batch-sizes needs integers >= 1"),
    (["bench_batch.py", "--batch-sizes=-4"], {}, 2, "--batch-sizes needs integers >= 1"),
    (["bench_batch.py", "--batch-sizes", "1,x"], {}, 2, "--batch-sizes takes comma-separated integers"),
    (["bench_batch.py", "--batch-sizes", "2,2"], {}, 2, "--batch-sizes lists 2 twice"),
    (["bench_batch.py", "--memory-cap", "0"], {}, 2, "--memory-cap must be a finite number of MiB > 0"),
    (["bench_batch.py", "--memory-cap", "nan"], {}, 2, "--memory-cap must be a finite number of MiB > 0"),
    (["bench_batch.py", "--memory-cap", "abc"], {}, 2, "invalid float value: 'abc'"),
    (["bench_batch.py", *SMALL, "--memory-cap", "0.01"], {}, 2, "--memory-cap 0.01 MiB is below the weights"),
    (["bench_batch.py", "--plot", "/proc/x.png"], {}, 2, "--plot /proc/x.png: cannot write"),
    (["bench_batch.py", "--memory-cap", "inf"], {}, 2, "--memory-cap must be a finite number of MiB > 0, got inf"),
    (["bench_batch.py", "--memory-cap=-1e300"], {}, 2, "--memory-cap must be a finite number of MiB > 0"),
    (["bench_batch.py", "--batch-sizes", "100000000000000000000"], {}, 2, "--batch-sizes must be at most 1048576"),
    (["bench_batch.py", "--batch-sizes", "1e20"], {}, 2, "--batch-sizes takes comma-separated integers"),
    (["bench_batch.py", "--batch-sizes", " , "], {}, 2, "--batch-sizes"),
    (["bench_batch.py", *SMALL, "--memory-cap", "1", "--batch-sizes", "1048576"], {}, 2,
     "--memory-cap 1 MiB holds no batch of 1048576"),
    (["bench_batch.py", "--policies", ""], {}, 2, "--policies is empty"),
    (["bench.py", "--policies", ""], {}, 2, "--policies is empty ('')"),
    (["bench.py", "--policies", ",,"], {}, 2, "--policies is empty"),
    (["bench_paired.py", "--policies", " , "], {}, 2, "--policies is empty (' , ')"),
    (["eval.py", "--depths", ""], {}, 2, "--depths is empty"),
    (["eval.py", "--depths", " , "], {}, 2, "--depths is empty"),
    (["bench_quant.py", "--modes", "int4-g7"], {}, 2, "unknown --modes entry 'int4-g7'"),
    (["bench_quant.py", "--modes", " , "], {}, 2, "--modes is empty"),
    (["bench_quant.py", "--modes", "int4-g\u0663\u0662"], {}, 2, "unknown --modes entry"),
    (["bench_quant.py", "--modes", "int4-g032"], {}, 2, "unknown --modes entry 'int4-g032'"),
    (["bench_quant.py", *SMALL, "--modes", "int4-g128"], {}, 2,
     "--modes int4-g128: --groupsize 128 does not divide the in-features"),
    (["bench_quant.py", "--random-weights", "--ppl-texts", "2"], {}, 2, "which --random-weights does not measure"),
    (["bench_quant.py", "--random-weights", "--ppl-prefix", "64"], {}, 2, "--ppl-texts, --ppl-prefix and --ppl-tok"),
    # ---- bench.py --resume
    (["bench.py", "--resume"], {}, 2, "--resume needs --json"),
    (["bench_paired.py", "--resume"], {}, 2, "unrecognized arguments: --resume"),
    (["bench.py", *SMALL, "--resume", "--json", "{tmp}/b.json"], {"b.json": "{oops"}, 2, "b.json is not JSON"),
    (["bench.py", *SMALL, "--resume", "--json", "{tmp}/b.json"], {"b.json": b"\xff"}, 2, "b.json is not JSON"),
    (["bench.py", *SMALL, "--resume", "--json", "{tmp}/b.json"], {"b.json": "[1]"}, 2, "b.json records no settings"),
    (["bench.py", *SMALL, "--resume", "--json", "{tmp}/b.json"], {"b.json": '{"settings": {}}'}, 2, "other settings"),
    (["bench_figure.py", "--resume"], {"fig/rocketkv_figure.json": ""}, 2, "rocketkv_figure.json is not JSON"),
    (["bench_quant.py", *SMALL, "--modes", "int8", "--resume", "--json", "{tmp}/q.json"], {"q.json": '{"settings": 1}'},
     2, "q.json records no settings"),
    # ---- frontier.py: its own flags, and eval.py's and bench.py's checks named as its flags
    (["frontier.py", "--budgets", "0"], {}, 2, "--budgets needs integers >= 1"),
    (["frontier.py", "--budgets", "32,abc"], {}, 2, "--budgets takes comma-separated integers, got '32,abc'"),
    (["frontier.py", "--budgets", "32,32"], {}, 2, "--budgets lists 32 twice"),
    (["frontier.py", "--budgets", "20", "--policies", "snapkv"], {}, 2,
     "snapkv: --budgets 20 must exceed the observation window (32)"),
    (["frontier.py", "--length", "0"], {}, 2, "--length must be >= 1, got 0"),
    (["frontier.py", "--length", "5000"], {}, 2, "--length + --decode-steps (5000 + 4)"),
    (["frontier.py", "--length", "2040", "--fid-tokens", "16"], {}, 2,
     "--length + --fid-tokens exceeds the model's context (2048)"),
    (["frontier.py", "--length", "10"], {}, 2, "needle at --length 10: "),
    (["frontier.py", "--random-weights", "--no-speed"], {}, 2, "nothing to run"),
    (["frontier.py", "--policies", "full,nope"], {}, 2, "unknown policy 'nope'"),
    (["frontier.py", "--policies", "sink,sink"], {}, 2, "--policies lists sink twice"),
    (["frontier.py", "--policies", "snapkv:window=0"], {}, 2, "snapkv: window must be >= 1, got 0"),
    (["frontier.py", "--depths", "2"], {}, 2, "--depths must be in [0, 1]"),
    (["frontier.py", "--depths", "0,0"], {}, 2, "--depths lists 0.0 twice"),
    (["frontier.py", "--task", "passkey"], {}, 2, "argument --task: invalid choice: 'passkey'"),
    (["frontier.py", "--rank", "speed"], {}, 2, "argument --rank: invalid choice: 'speed'"),
    (["frontier.py", "--decode-steps", "1"], {}, 2, "--decode-steps must be >= 2, got 1"),
    (["frontier.py", "--repeats", "0"], {}, 2, "--repeats must be >= 1, got 0"),
    (["frontier.py", "--threads", "0"], {}, 2, "--threads must be between 1 and 1024, got 0"),
    (["frontier.py", "--samples", "0"], {}, 2, "--samples must be >= 1"),
    (["frontier.py", "--fid-texts", "0"], {}, 2, "--fid-texts must be >= 1"),
    (["frontier.py", "--block-size", "5000"], {}, 2, "--block-size 5000 is larger than the model's context (2048)"),
    (["frontier.py", "--device", "cuda"], {}, 2, "--device cuda was asked for but CUDA is not available"),
    (["frontier.py", "--resume"], {"out/frontier.json": "{"}, 2, "frontier.json is not JSON"),
    (["frontier.py", "--resume"], {"out/frontier.json": "{}"}, 2, "frontier.json records no settings"),
    # ---- bench_kvpress.py (HF + kvpress side; runs in .venv-kv)
    (["bench_kvpress.py"], {}, 2, "ids.json: No such file or directory"),
    (["bench_kvpress.py", "--budget", "0"], {"ids.json": "[1]"}, 2, "--budget must be >= 1"),
    (["bench_kvpress.py", "--budget", "x"], {"ids.json": "[1]"}, 2, "invalid int value: 'x'"),
    (["bench_kvpress.py", "--decode-steps", "0"], {"ids.json": "[1]"}, 2, "--decode-steps must be >= 1"),
    (["bench_kvpress.py", "--repeats", "-2"], {"ids.json": "[1]"}, 2, "--repeats must be >= 1"),
    (["bench_kvpress.py"], {"ids.json": "[1, 2"}, 2, "ids.json is not JSON"),
    (["bench_kvpress.py"], {"ids.json": b"\xff\xfe"}, 2, "ids.json is not JSON"),
    (["bench_kvpress.py"], {"ids.json": "{}"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_kvpress.py"], {"ids.json": "[]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_kvpress.py"], {"ids.json": "[-1]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_kvpress.py"], {"ids.json": '["a"]'}, 2, "not a non-empty JSON list of token ids"),
    (["bench_kvpress.py"], {"ids.json": "[true]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_kvpress.py"], {"ids.json": "[1.5]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_kvpress.py"], {"ids.json/": None}, 2, "ids.json: Is a directory"),
    # ---- bench_llamacpp.py (llama.cpp side; runs in .venv-llamacpp): every check before llama_cpp is imported
    (["bench_llamacpp.py"], {}, 2, "ids.json: No such file or directory"),
    (["bench_llamacpp.py"], {"ids.json/": None}, 2, "ids.json: Is a directory"),
    (["bench_llamacpp.py"], {"ids.json": "[1, 2"}, 2, "ids.json is not JSON"),
    (["bench_llamacpp.py"], {"ids.json": b"\xff"}, 2, "ids.json is not JSON"),
    (["bench_llamacpp.py"], {"ids.json": "[]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_llamacpp.py"], {"ids.json": "[-1]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_llamacpp.py"], {"ids.json": "[false]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_llamacpp.py"], {"ids.json": "[2.0]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_llamacpp.py"], {"ids.json": "[4294967296]"}, 2, "not a non-empty JSON list of token ids"),
    (["bench_llamacpp.py"], {"ids.json": '{"ids": [1]}'}, 2, "not a non-empty JSON list of token ids"),
    (["bench_llamacpp.py", "--decode-steps", "0"], {"ids.json": "[1]"}, 2, "--decode-steps must be >= 1"),
    (["bench_llamacpp.py", "--repeats", "0"], {"ids.json": "[1]"}, 2, "--repeats must be >= 1"),
    (["bench_llamacpp.py", "--threads", "-1"], {"ids.json": "[1]"}, 2, "--threads must be >= 1"),
    (["bench_llamacpp.py", "--threads", "two"], {"ids.json": "[1]"}, 2, "invalid int value: 'two'"),
    (["bench_llamacpp.py", "--kv-type", "q8_0"], {"ids.json": "[1]"}, 2, "invalid choice: 'q8_0'"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/none.gguf"], {"ids.json": "[1]"}, 2, "none.gguf: No such file"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/d"], {"ids.json": "[1]", "d/": None}, 2, "d: Is a directory"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/x.gguf"], {"ids.json": "[1]", "x.gguf": "not one"}, 2,
     "x.gguf is not a GGUF file"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/x.gguf"], {"ids.json": "[1]", "x.gguf": ""}, 2, "is not a GGUF file"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/m.gguf", "--dequantize", "{tmp}/d"], GGUF | {"d/": None}, 2,
     "/d is a folder: give the F32 GGUF's file name"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/m.gguf", "--dequantize", "{tmp}/no/f32.gguf"], GGUF, 2,
     "/no/f32.gguf: no folder"),
    (["bench_llamacpp.py", "--gguf", "{tmp}/m.gguf", "--dequantize", "{tmp}/m.gguf"], GGUF, 2,
     "is the --gguf itself"),
]


@pytest.fixture(scope="module")
def ckpt(hf_tiny, tmp_path_factory):
    from conftest import with_tiny_tokenizer
    _, src = hf_tiny("llama")
    return with_tiny_tokenizer(src, tmp_path_factory.mktemp("tiny_fuzz"),
                               "the quick brown fox jumps over the lazy dog 0123456789")


def files_in(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def run(script, argv, monkeypatch):
    """The script's main() in this process; its exit code."""
    def never(*a, **k):
        raise AssertionError("bad input got as far as loading a model or starting a configuration")
    monkeypatch.setattr(ev, "load_model", never)
    for module in (benchlib, *BENCH.values()):  # each name where a script looks it up
        for name in ("load_model", "run_one", "read_bandwidth_gb_s"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, never)
    try:
        if script == "eval.py":
            return ev.main(argv)
        if script == "frontier.py":
            monkeypatch.setattr(frontier, "load_model", never)
            monkeypatch.setattr(frontier, "run_child", never)
            return frontier.main(argv)
        if script in BENCH:
            monkeypatch.setattr(sys, "argv", [script, *argv])
            return BENCH[script].main()
        if script == "bench_llamacpp.py":
            monkeypatch.setattr(bench_llamacpp, "import_llama_cpp", never)
            return bench_llamacpp.main(argv)
        return bench_kvpress.main(argv)
    except SystemExit as e:  # argparse's errors
        return e.code


def test_the_table_is_large():
    assert len(CASES) >= 100


@pytest.mark.parametrize("argv, files, code, message", CASES, ids=[f"{c[0][0]}:{c[3]}" for c in CASES])
def test_bad_input_one_line(argv, files, code, message, ckpt, tmp_path, monkeypatch, capsys):
    for name, content in files.items():
        path = tmp_path / name.removesuffix("|")
        if name.endswith("/"):
            path.mkdir(parents=True)
            continue
        if name.endswith("|"):  # a named pipe nobody writes to or reads from
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkfifo(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    before = files_in(tmp_path)
    script, *args = argv
    args = [a.format(tmp=tmp_path, ckpt=ckpt) for a in BASE[script] + args]
    got = run(script, args, monkeypatch)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    message = message.replace("{tmp}", str(tmp_path))
    assert got == code and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err
    assert files_in(tmp_path) == before  # nothing written, nothing changed (an empty --out-dir may be made)


# ---- scripts/check_port.py (numpy only: "check_port: " and the line, exit 2). Each case: (what it breaks, extra
# argv, message); the vectors are a copy of tests/vectors and the results the engine's own keydiff-gqa-b16 output
# (a bad result is one case's line; the others are still checked).
CASE = "keydiff-gqa-b16"


def kept_as(value, dtype="float32"):
    def change(vectors, results):
        from safetensors.numpy import load_file, save_file
        kept = load_file(str(results / f"{CASE}.safetensors"))["kept"].astype(dtype)
        kept[kept == 1] = value
        save_file({"kept": kept}, str(results / f"{CASE}.safetensors"))
    return change


def manifest_edit(edit):
    def change(vectors, results):
        m = json.loads((vectors / "manifest.json").read_text())
        edit(m)
        (vectors / "manifest.json").write_text(json.dumps(m))
    return change


def short_steps(m):
    m["cases"][0]["steps"] = m["cases"][0]["steps"][:-1]


CHECK_PORT = [
    (kept_as(1.5), [], f"{CASE}: kept holds 1.5, but a count is a whole number from 0 to 2"),
    (kept_as(float("nan")), [], f"{CASE}: kept holds nan"),
    (kept_as(float("inf")), [], f"{CASE}: kept holds inf"),
    (kept_as(3, "int64"), [], f"{CASE}: kept holds 3"),
    (kept_as(-1, "int8"), [], f"{CASE}: kept holds -1"),
    (manifest_edit(short_steps), [], f"{CASE}: the manifest lists 5 steps, its vectors 6"),
    (manifest_edit(lambda m: m.pop("shapes")), [], "malformed vectors or results (KeyError: 'shapes')"),
    (manifest_edit(lambda m: m.update(cases=[])), [], "not a test-vector manifest"),
    (manifest_edit(lambda m: m["cases"][0].update(file="cases/none.safetensors")), [], "none.safetensors: no such file"),
    (None, ["--case", "nope*"], "--case 'nope*' matches none of the manifest's"),
    (None, ["--case", ""], "--case '' matches none"),
    (lambda v, r: (v / "manifest.json").write_text("{"), [], "manifest.json: not a test-vector manifest"),
    (lambda v, r: (v / "manifest.json").write_text(DEEP), [], "manifest.json: not a test-vector manifest"),
    (lambda v, r: (v / "manifest.json").unlink(), [], "no manifest.json"),
    (lambda v, r: (r / f"{CASE}.safetensors").write_bytes(b"\x00" * 8), [], "not a readable safetensors file"),
]


@pytest.mark.parametrize("change, extra, message", CHECK_PORT, ids=[c[2][:40] for c in CHECK_PORT])
def test_check_port_bad_input_one_line(change, extra, message, tmp_path, capsys):
    import shutil

    from conftest import REPO
    sys.path.append(str(REPO / "scripts"))  # after the repository: scripts/quantize.py is not quantize.py
    import check_port
    vectors, results = tmp_path / "vectors", tmp_path / "results"
    shutil.copytree(REPO / "tests" / "vectors", vectors)
    results.mkdir()
    shutil.copy(vectors / "cases" / f"{CASE}.safetensors", results)
    if change is not None:
        change(vectors, results)
    code = check_port.main([str(vectors), str(results), *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("check_port: ") and message in lines[0], err
    assert not out or ", 1 with bad input)" in out  # the bad case is counted, no case is said to match


# ---- every script: run directly, and every flag at its edge values (the table is made from each script's parser,
# so a new flag or script gets its rows without being listed)
SCRIPTS = sorted(p.stem for p in (REPO / "scripts").glob("*.py") if p.stem != "__init__")
PARTS = {"benchlib", "eval_journal", "eval_report", "eval_tasks", "outputs", "peer"}  # imported by the commands
EDGE = ["0", "-1", "99999999999999999999", "nan", "", "x"]  # 0, negative, huge, NaN, empty, the wrong type
TINY = ["--checkpoint", "{ckpt}"]
SHAPES = ["--checkpoint", "{tmp}/shapes"]  # a config.json alone: the shapes --random-weights builds
COMMON = ["--decode-steps", "8", "--device", "cpu", "--threads", "1"]
ARGS = {  # each command's arguments that make it small and keep its outputs in the case's folder
    "bench": TINY + COMMON + ["--prompt-tokens", "100"],
    "bench_attention": SHAPES + ["--slots", "64", "--tokens", "1", "--repeats", "1", "--threads", "1"],
    "bench_batch": TINY + COMMON + ["--prompt-tokens", "100"],
    "bench_compile": TINY + ["--prompt-tokens", "100", "--new-tokens", "4", "--threads", "1", "--json", "{tmp}/c.json"],
    "bench_figure": TINY + COMMON + ["--contexts", "64", "--budgets", "16", "--out-dir", "{tmp}/fig"],
    "bench_kvpress": ["--model", "{tmp}/hf", "--press", "none", "--budget", "8", "--ids-file", "{tmp}/ids.json"],
    "bench_linear": SHAPES + ["--rows", "1", "--repeats", "1", "--threads", "1"],
    "bench_llamacpp": ["--ids-file", "{tmp}/ids.json", "--threads", "1"],
    "bench_paired": TINY + COMMON + ["--prompt-tokens", "100"],
    "bench_quant": TINY + COMMON + ["--prompt-tokens", "100", "--modes", "int8"],
    "bench_speculate": TINY + ["--policies", "sink", "--budgets", "16", "--ks", "2", "--contexts", "64", "--weights",
                               "float32", "--new-tokens", "4", "--threads", "1", "--device", "cpu"],
    "bench_threads": ["--prompt-bytes", "100", "--new-tokens", "2", "--repeats", "1"],
    "bench_tp": SHAPES + ["--prompt-tokens", "32", "--block-size", "16", "--budget", "16", "--steps", "2", "--device",
                          "cpu", "--threads", "1"],
    "check_port": [str(REPO / "tests" / "vectors"), "{tmp}/results"],
    "convert_hf_checkpoint": TINY,
    "download": ["--repo-id", "org/model", "--out-dir", "{tmp}/d"],
    "eval": BASE["eval.py"],
    "frontier": TINY + ["--length", "64", "--budgets", "16", "--policies", "sink", "--no-speed", "--fid-tokens", "8",
                        "--out-dir", "{tmp}/fr"],
    "gpu_check": ["--device", "cpu", "--out", "{tmp}/g", "--no-compile"],
    "make_vectors": ["{tmp}/vectors"],
    "quantize": TINY + ["--mode", "int8", "--out", "{tmp}/q"],
}


class Reached(BaseException):
    """The command got past its checks to its work (a stub below): the value was taken."""


def stubbed(monkeypatch):
    """What starts a command's work, made to raise Reached: loading or building a model, a child process, a
    compile, a conversion, vectors written, the bandwidth measured."""
    import cli
    import convert
    import loading
    import quantize
    import torch
    import tp

    def reach(*a, **k):
        raise Reached
    for module, names in ((loading, ["load_model", "random_model"]), (tp, ["load_model", "random_model"]),
                          (cli, ["run_child", "start_child"]), (torch, ["compile"]),
                          (convert, ["convert_hf_dir", "convert_gguf", "write_hf"]), (quantize, ["quantize_dir"]),
                          (benchlib, ["load_model", "random_model", "run_child", "read_bandwidth_gb_s"])):
        for name in names:
            monkeypatch.setattr(module, name, reach)
    from transformers import AutoModelForCausalLM  # bench_kvpress.py's models
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", reach)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", reach)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # download.py: one line, no network


def run_script(name: str, argv: list[str], monkeypatch):
    """scripts/NAME.py as `python scripts/NAME.py ARGV` runs it, in this process: its exit code, or Reached."""
    import runpy
    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / f"{name}.py"), *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository first
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code
    except Reached:
        return Reached
    return 0


class Captured(BaseException):
    pass


def parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser scripts/NAME.py parses its command line with (caught at its parse_args)."""
    def capture(self, args=None, namespace=None):
        raise Captured(self)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        try:
            run_script(name, [], m)
        except Captured as c:
            return c.args[0]
    raise AssertionError(f"scripts/{name}.py parsed no command line")


def test_every_script_is_a_command_or_a_part():
    assert set(SCRIPTS) == PARTS | set(ARGS), "a new script: give it ARGS (a command) or put it in PARTS"


def test_every_script_runs_directly_with_help():
    """python scripts/NAME.py --help, as a user types it (a fresh interpreter, the script's folder first on the
    path): a usage line and exit 0, for the commands and for the parts (which say whose part they are)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    procs = {}
    for name in SCRIPTS:  # two at a time: each imports torch
        procs[name] = subprocess.Popen([sys.executable, f"scripts/{name}.py", "--help"], cwd=REPO, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if len(procs) % 2 == 0:
            list(procs.values())[-2].wait(120)
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.startswith("usage:") and "Traceback" not in err, (name, out[:200], err)


def edge_rows(name: str, monkeypatch) -> list[tuple[str, str]]:
    """(flag, value) for every flag of the command that takes a value, at each EDGE value."""
    return [(action.option_strings[-1], value) for action in parser_of(name, monkeypatch)._actions
            if action.option_strings and action.nargs != 0 for value in EDGE]


def edge_folder(tmp_path, ckpt, monkeypatch) -> None:
    """The case's folder as ARGS name it, the work stubbed, and the folder the current one."""
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "config.json").write_bytes((ckpt / "config.json").read_bytes())
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    (tmp_path / "results").mkdir()
    stubbed(monkeypatch)
    monkeypatch.chdir(tmp_path)  # a relative output path lands here


REFUSED = [  # edge values a command took and then failed on, or worked on without end: now refused in one line
    ("bench_tp", "--prompt-tokens", "0", 2, "--prompt-tokens must be between 1 and 2147483647, got 0"),
    ("bench_tp", "--steps", "0", 2, "--steps must be between 1 and 2147483647, got 0"),
    ("bench_tp", "--steps", "5000", 2, "--prompt-tokens + 2 x --steps + 3 (32 + 10003), --block-size (16) and "
                                       "--budget (16) must fit the model's context (2048)"),
    ("bench_linear", "--threads", "0", 2, "--threads must be between 1 and 1024, got 0"),
    ("bench_linear", "--repeats", "99999999999999999999", 2, "--repeats must be between 1 and 1000"),
    ("bench_attention", "--threads", "0", 2, "--threads must be between 1 and 1024, got 0"),
    ("bench_attention", "--repeats", "99999999999999999999", 2, "--repeats must be between 1 and 1000"),
    ("bench_batch", "--one", "0", 2, "--one '0': a flag this script passes its own runs"),
    ("bench_batch", "--one-prefill", "x", 2, "--one-prefill 'x': a flag this script passes its own runs"),
    ("bench_compile", "--prompt-tokens", "99999999999999999999", 2,
     "--prompt-tokens + --new-tokens (99999999999999999999 + 4) must fit the model's context (2048)"),
    ("bench_compile", "--repeats", "99999999999999999999", 2, "--repeats must be between 1 and 1000"),
    ("bench_speculate", "--threads", "99999999999999999999", 2, "--threads must be between 1 and 1024"),
    ("bench_speculate", "--repeats", "99999999999999999999", 2, "--repeats must be between 1 and 1000"),
    ("bench_kvpress", "--repeats", "99999999999999999999", 2, "--repeats must be at most 1000"),
]


@pytest.mark.parametrize("name, flag, value, code, message", REFUSED, ids=[f"{r[0]}{r[1]}={r[2]}" for r in REFUSED])
def test_an_edge_value_is_refused_before_the_work(name, flag, value, code, message, ckpt, tmp_path, monkeypatch,
                                                  capfd):
    edge_folder(tmp_path, ckpt, monkeypatch)
    got = run_script(name, [a.format(tmp=tmp_path, ckpt=ckpt) for a in ARGS[name]] + [flag, value], monkeypatch)
    err = capfd.readouterr().err.strip().splitlines()
    assert got == code and len(err) == 1 and err[0].startswith(f"error: {message}"), (got, err)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_every_flag_at_its_edge_values_is_taken_or_one_line(name, ckpt, tmp_path, monkeypatch, capfd):
    """Every flag that takes a value, of every command, at 0, -1, a huge number, nan, empty and a word: the command
    either takes it (it gets to its work, stubbed) or refuses it in one line, exit 2 (1 where the environment is
    what failed: no network, no llama.cpp) — never a traceback or an internal error."""
    edge_folder(tmp_path, ckpt, monkeypatch)
    for flag, value in edge_rows(name, monkeypatch):
        argv = [a.format(tmp=tmp_path, ckpt=ckpt) for a in ARGS[name]] + [flag, value]
        code = run_script(name, argv, monkeypatch)
        out, err = capfd.readouterr()
        lines = err.strip().splitlines()
        if code is Reached or code == 0:
            continue
        assert code in (1, 2) and "Traceback" not in err and not err.startswith("internal error"), (flag, value, err)
        assert len(lines) == 1 and lines[0].startswith(("error: ", "check_port: ")), (flag, value, err)


def test_bench_figure_defaults_fit_the_default_checkpoint():
    """bench_figure.py with no flags runs on its default checkpoint: its longest default context and its decode
    steps fit SmolLM2-135M's context (the paper's 16K+ contexts would be refused there in one line)."""
    from checkpoint import shape_config
    a = bench_figure.parser().parse_args([])
    config, _ = shape_config(a.checkpoint)
    contexts = benchlib.int_list(a.contexts, "--contexts")
    assert max(contexts) + a.decode_steps + a.block_size <= config["max_position_embeddings"] == 8192

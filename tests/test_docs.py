"""The docs stay true to the code: docs/architecture.md's module table lists exactly the modules beside it, its
porter's path and decode-step path name definitions and files that exist, and every command README.md and
docs/*.md write is run here at tiny sizes or names where it runs instead."""
import importlib.util
import io
import json
import re
import shlex
import shutil
import sys

import pytest

from conftest import REPO

DOC = (REPO / "docs" / "architecture.md").read_text()


def test_module_table_is_the_modules_on_disk():
    table = DOC[DOC.index("| module | holds |"):DOC.index("No module imports")]
    listed = set(re.findall(r"`(\w+\.py)`", "".join(line.split("|")[1] for line in table.splitlines()[2:] if line)))
    assert listed == {p.name for p in REPO.glob("*.py")}


def section(title: str) -> str:
    part = DOC[DOC.index(title):]
    return part[:part.index("\n## ", 1)]


def test_the_porters_path_and_the_decode_step_name_what_exists():
    """Every `module.Name` or `module.Name.method` they name is defined there, every file they name exists (by
    name, never by line range: an edit above a definition does not move the path)."""
    for title in ("## Porting a policy", "## A decode step, module by module"):
        text = section(title)
        for path in re.findall(r"`((?:examples|scripts)/\w+\.py)`", text):
            assert (REPO / path).is_file(), path
        for module, *names in (ref.split(".") for ref in re.findall(r"`((?:[a-z_]+)(?:\.[A-Za-z_]+)+)`", text)):
            if not (REPO / f"{module}.py").is_file() or names == ["py"]:  # a file named, not a definition
                continue
            source = (REPO / f"{module}.py").read_text()
            for name in names[:1]:
                assert re.search(rf"^\s*(def|class) {name}\b|^{name} = ", source, re.M), f"{module}.{name}"
            if len(names) == 2:
                assert re.search(rf"^\s+def {names[1]}\b", source, re.M), f"{module}.{'.'.join(names)}"


# ------------------------------------------------------------------------------------ the commands the docs write

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNER = re.compile(r"(?:[A-Z_]+=\S+ )*(?:\.venv/bin/python|python3?|torchrun|bash) ")
SCRIPT_WITH_FLAGS = re.compile(r"[\w/]+\.py(?: --[\w-]+(?: [^-\s]\S*)?){2,}$")  # an inline `generate.py --a x --b`


def doc_commands() -> set[str]:
    """Every command line the reference docs write: each line of a code block (continuations joined, comments
    dropped) and each inline `...` that starts with a runner (python, torchrun, bash) or names a script with two
    flags or more."""
    found = set()
    for doc in DOCS:
        text = doc.read_text()
        blocks = re.findall(r"```\w*\n(.*?)```", text, re.S) + re.findall(r"(?m)(?:^    \S.*\n)+", text)
        lines = [line.strip() for b in blocks for line in re.sub(r"\\\n\s*", "", b).splitlines()]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        lines += [re.sub(r"\s+", " ", span) for span in re.findall(r"`([^`]+)`", prose)]
        for line in lines:
            line = re.sub(r"\s+#.*", "", line)
            if (RUNNER.match(line) or SCRIPT_WITH_FLAGS.match(line)) and not line.endswith(" ..."):
                found.add(line)
    return found


RUN = "run here"
PY = ".venv/bin/python "
DOC_TXT = " ".join(["the quick brown fox jumps over the lazy dog."] * 90)  # ~900 tokens of the tiny tokenizer
# command -> RUN (tiny_argv runs it on the tiny model) or where it runs instead, or why it cannot run on a CPU
COMMANDS = {
    # README.md
    f'bash scripts/setup.sh && {PY}generate.py --policy keydiff --budget 256 --prompt "What is the capital of France?"':
        RUN,
    f"bash scripts/setup.sh test && {PY}-m pytest -q -n 2 --dist loadfile tests": "the suite itself (.ci/run)",
    f"{PY}generate.py --checkpoint llama3.1-8b --policy keydiff --budget 2048 --prompt-file doc.txt --compile": RUN,
    f'{PY}generate.py --policy snapkv:window=32,kernel=7 --budget 512 --prompt "..."': RUN,
    f"{PY}generate.py --policy rocketkv:read=256 --budget 1024 --prompt-file doc.txt --repetition-penalty 1.1": RUN,
    f'{PY}generate.py --policy snapkv --prompt-file doc.txt --prompt "Who wrote it?" --repetition-penalty 1.1': RUN,
    f"{PY}generate.py --policy keydiff --budget 512 --prompt-file prompts.jsonl": RUN,
    f"{PY}generate.py --interactive --policy keydiff --budget 512": RUN,
    f"{PY}generate.py --policy kvec --help": RUN,
    f"{PY}generate.py --help": RUN,
    "TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh": "installs CUDA torch",
    f"{PY}scripts/make_vectors.py": "tests/test_porting.py (regenerates the vectors, kept sets compared bit for bit)",
    f"{PY}-m pytest -q tests/test_conformance.py -k valuenorm":
        "tests/test_conformance.py::test_readme_example_is_one_scorer_tested_here (the example, tested unregistered)",
    "generate.py --checkpoint llama3.2-1b --random-weights --prompt-tokens 2048 --policy keydiff --budget 512": RUN,
    # performance.md
    f"{PY}scripts/bench_threads.py --repeats 2": "times the embedded model under each thread setting and case",
    "generate.py --policy keydiff --budget 512 --max-new-tokens 6000 --repetition-penalty 1.1 --json":
        "a 17-minute run, its memory sampled from outside (tests/test_chat.py checks the per-turn peak)",
    "generate.py --interactive --policy keydiff --budget 512 --max-new-tokens 48":
        "tests/test_chat.py (50 turns through stdin, the per-turn peak flat)",
    "python3 -c": "a pipeline's reader, named in prose",
    f"{PY}scripts/bench_compile.py --policy keydiff --budget 512 --prompt-tokens 4096 --new-tokens 128 --threads 2 "
    "--repeats 2": "tests/test_cli.py::test_bench_compile_measures_eager_cold_and_warm",
    f"{PY}scripts/bench_paired.py --compile --policies keydiff --decode-steps 64 --threads 2":
        "tests/test_cli.py::test_bench_paired_table_and_profile",
    f"{PY}scripts/bench.py --prompt-tokens 4096 --budget 512 --decode-steps 32 --repeats 3 --kvpress":
        "not run by a test: a process per policy and the kvpress peer take minutes at tiny sizes",
    f"{PY}scripts/bench.py --compile --prompt-tokens 4096 --budget 512 --policies keydiff --decode-steps 32 "
    "--repeats 3 --llamacpp": "tests/test_bench_llamacpp.py (.venv-llamacpp)",
    f"{PY}scripts/bench.py --compile --prompt-tokens 7600 --budget 512 --policies keydiff --decode-steps 32 "
    "--repeats 3 --llamacpp": "tests/test_bench_llamacpp.py (.venv-llamacpp)",
    "bash scripts/setup.sh llamacpp": "installs llama.cpp's venv",
    f"{PY}scripts/bench_batch.py --checkpoint smollm2-135m --prompt-tokens 8176 --budget 512 --memory-cap 4096 "
    "--threads 2 --decode-steps 10 --compile --policies keydiff --json build/batch_8k.json "
    "--plot docs/batch_throughput.png": "tests/test_gpu_check.py::test_batch_section_runs_bench_batch_to_the_cap",
    f"{PY}scripts/bench_figure.py --contexts 8000,4096,2048 --budgets 256,512,1024 --threads 1":
        "tests/test_resume.py::test_bench_resume_runs_only_the_rest[figure]",
    # porting.md
    "python scripts/check_port.py tests/vectors RESULTS [--case 'keydiff-*']": "a template: RESULTS is a port's output",
    **{f"python examples/port_{p}.py tests/vectors /tmp/{p} && python scripts/check_port.py tests/vectors /tmp/{p}":
       "tests/test_porting.py" for p in ("keydiff", "snapkv", "tova", "h2o")},
    "python scripts/make_vectors.py": "tests/test_porting.py (regenerates the vectors, kept sets compared bit for bit)",
    "python scripts/convert_hf_checkpoint.py --checkpoint smollm2-135m --to-hf /tmp/smollm2-hf":
        "tests/test_hf_port.py::test_keydiff_port_into_hf_keeps_budgetkvs_positions_at_every_layer_and_head",
    "python examples/port_hf_keydiff.py /tmp/smollm2-hf --budget 20":
        "tests/test_hf_port.py (its generate(), on the copy the line above writes)",
    "scripts/convert_hf_checkpoint.py --checkpoint CKPT --to-hf OUT": "a template: CKPT is any checkpoint",
    # quantization.md
    f"{PY}scripts/quantize.py --checkpoint smollm2-135m --mode int8": RUN,
    f"{PY}scripts/quantize.py --checkpoint smollm2-135m --mode int4": RUN,
    f"{PY}generate.py --checkpoint checkpoints/smollm2-135m-int8 --policy keydiff --budget 256 --kv-dtype int8 "
    "--prompt-file doc.txt": RUN,
    f"{PY}scripts/bench_quant.py --prompt-tokens 512 --threads 1":
        "tests/test_resume.py::test_bench_resume_runs_only_the_rest[quant]",
    # results.md
    "bash scripts/setup.sh test": "installs the test requirements",
    f"{PY}scripts/eval.py --quick --threads 1": "tests/test_eval.py::test_quick_cli_writes_outputs",
    f"{PY}scripts/eval.py --threads 1": RUN,
    f"{PY}scripts/eval.py --checkpoint llama3.1-8b --budgets 512,1024,2048,4096 --lengths 4096,8192,16384 --tasks "
    "fidelity,passkey,niah_single,niah_multikey,niah_multivalue,variable_tracking,common_words,needle --samples 20 "
    "--prefill block,one-shot --compile --longbench en16 --longbench-source LongBench/data":
        "GPU (LongBench: tests/test_eval.py::test_longbench_average)",
    f"{PY}scripts/eval.py --threads 1 --tasks fidelity --budgets 256,1024": RUN,
    f'{PY}generate.py --prompt-file doc.txt --prompt "In which year and month was this license published?" --policy '
    "keydiff --max-new-tokens 96 --repetition-penalty 1.1": RUN,
    f'{PY}scripts/eval.py --threads 1 --tasks fidelity --budgets 256,1024 --policies "caote:h2o,fastcaote:h2o,'
    "caote:tova,fastcaote:tova,caote:snapkv,fastcaote:snapkv,caote:keydiff,fastcaote:keydiff,snapkv++,rocketkv,"
    'exact-topk,sagekv,kvec"': RUN,
    f'{PY}scripts/eval.py --tasks freegen --policies "full,keydiff,h2o,keynorm,caote:keydiff,caote:h2o,fastcaote:h2o,'
    'caote:tova,caote:snapkv,sink,snapkv,tova,random,snapkv++,rocketkv,sagekv,kvec" --budgets 256,1024 --fid-prefix '
    "2048 --gen-tokens 96 --fid-texts 2 --threads 1": RUN,
    f"{PY}scripts/frontier.py --length 4096 --budgets 128,256,512,1024":
        "tests/test_frontier.py::test_rows_front_table_and_png (its bench.py --one processes: "
        "::test_speed_is_bench_py_one_in_its_own_process)",
    f"{PY}scripts/frontier.py --checkpoint llama3.1-8b --random-weights --length 8192 --budgets 512,1024,2048,4096":
        "GPU (tests/test_frontier.py::test_random_weights_measure_speed_only)",
    f"{PY}scripts/frontier.py --length 2048 --budgets 128,256,512,1024 --policies full,random,sink,h2o,tova,snapkv,"
    "keydiff,keynorm --no-speed --threads 1 --out-dir build/frontier-2k":
        "tests/test_frontier.py::test_resume_after_sigkill (--no-speed)",
    f"{PY}scripts/frontier.py --random-weights --length 2048 --budgets 256,1024 --policies full,random,sink,h2o,tova,"
    "snapkv,keydiff,keynorm --out-dir build/frontier-2k-speed":
        "tests/test_frontier.py::test_random_weights_measure_speed_only",
    f"{PY}scripts/frontier.py --length 4096 --budgets 256,512,1024 --policies full,sink,h2o,tova,snapkv,keydiff "
    "--no-speed --threads 1 --out-dir build/frontier-4k":
        "tests/test_frontier.py::test_resume_after_sigkill (--no-speed)",
    # speculative.md
    f"{PY}generate.py --prompt-file doc.txt --speculate 4 --draft-policy snapkv --draft-budget 256": RUN,
    f"{PY}generate.py --prompt-file doc.txt --speculate 4 --draft-policy sink:n_sink=4 --draft-budget 512 --compile":
        RUN,
    f"{PY}generate.py --prompt-file doc.txt --speculate 4 --draft-checkpoint checkpoints/smollm2-135m-int4-g32": RUN,
    f"{PY}scripts/bench_speculate.py --policies sink,tova --budgets 256,1024 --ks 2,4 --contexts 8000 --weights int8 "
    "--new-tokens 32 --repeats 2 --threads 2 --compile --json build/spec-int8-budgets.json":
        "tests/test_bench_speculate.py::test_grid_end_to_end",
    # tensor_parallel.md
    "torchrun --nproc-per-node 8 generate.py --checkpoint /models/Llama-3.1-70B-Instruct --policy keydiff --budget 2048 "
    "--prompt-file doc.txt --compile": "8 GPUs",
    "torchrun --nproc-per-node 2 generate.py --random-weights --checkpoint qwen2.5-0.5b --prompt-tokens 512 --policy "
    "keydiff --budget 256 --threads 1": "tests/test_tp.py::test_cli_under_torchrun",
    "torchrun --nproc-per-node 2 scripts/bench_tp.py --checkpoint llama3.1-8b --policy keydiff --budget 2048 "
    "--prompt-tokens 8192 --compile": "tests/test_tp.py::test_bench_tp",
    f"""{PY}-c "import json, tp; print(tp.memory_table(json.load(open('configs/llama3.1-70b.json'))))\"""": RUN,
    # testing.md
    "TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test": "installs CUDA torch",
    "bash scripts/gpu_check.sh": "GPU",
    "bash scripts/gpu_check.sh --only figure": "GPU",
    "bash scripts/gpu_check.sh --only speculate,batch": "GPU",
    "PYTHON=python3 bash scripts/gpu_check.sh": "GPU",
}


def test_every_command_in_the_docs_is_in_the_table():
    """A command added to the docs or changed there is run here at tiny sizes or names where it runs."""
    found = doc_commands()
    assert found - set(COMMANDS) == set(), "add these to COMMANDS"
    assert set(COMMANDS) - found == set(), "these are no longer in the docs"


@pytest.fixture(scope="module")
def tiny(hf_tiny, tmp_path_factory):
    """The names the docs' commands use, mapped to tiny stand-ins: the tiny llama with a tokenizer for each
    checkpoint, its config alone for --random-weights, its int8 and int4 quantizations; doc.txt and prompts.jsonl."""
    from conftest import with_tiny_tokenizer
    from scripts import quantize
    _, src = hf_tiny("llama")
    d = tmp_path_factory.mktemp("doc_commands")
    ckpt = with_tiny_tokenizer(src, d / "tiny", "the quick brown fox jumps over the lazy dog 0123456789")
    (d / "shapes").mkdir()
    shutil.copy(ckpt / "config.json", d / "shapes" / "config.json")
    for mode in ("int8", "int4"):
        assert quantize.main(["--checkpoint", str(ckpt), "--mode", mode, "--out", str(d / mode)]) == 0
    (d / "doc.txt").write_text(DOC_TXT)
    (d / "prompts.jsonl").write_text('{"prompt": "the quick fox"}\n{"prompt": "the lazy dog jumps over"}\n')
    return d, {"smollm2-135m": str(ckpt), "llama3.1-8b": str(ckpt), "llama3.2-1b": str(d / "shapes"),
               "checkpoints/smollm2-135m-int8": str(d / "int8"), "checkpoints/smollm2-135m-int4-g32": str(d / "int4")}


def tiny_argv(command: str, names: dict, out) -> tuple[str, list[str]]:
    """The command's script and flags at tiny sizes: its checkpoints mapped to the tiny ones (the tiny llama where it
    names none), fewer tokens and budgets, outputs under `out`, no --compile (compiled runs have tests of their own)."""
    words = shlex.split(command.split(" && ")[-1])
    words = words[1:] if "python" in words[0] else words
    script, args = words[0], [names.get(w, w) for w in words[1:] if w != "--compile"]
    if script == "-c":
        return script, args
    extra = [] if "--checkpoint" in args or "--help" in args else ["--checkpoint", names["smollm2-135m"]]
    if script == "generate.py" and "--help" not in args:
        extra += ["--max-new-tokens", "8"] + (["--prompt-tokens", "64"] if "--random-weights" in args else [])
    if script == "scripts/quantize.py":
        extra += ["--out", str(out / "quantized")]
    if script == "scripts/eval.py":
        extra += ["--budgets", "48,64", "--lengths", "300", "--depths", "0", "--fid-prefix", "64", "--fid-tokens",
                  "8", "--gen-tokens", "8", "--max-new-tokens", "4", "--block-size", "16", "--out-dir", str(out / "eval")]
    return script, args + extra


@pytest.mark.parametrize("command", [c for c, how in COMMANDS.items() if how == RUN])
def test_doc_command_runs_at_tiny_sizes(command, tiny, tmp_path, monkeypatch, capsys):
    import generate
    from scripts import eval as ev
    from scripts import quantize
    folder, names = tiny
    monkeypatch.chdir(folder)  # doc.txt and prompts.jsonl, as the docs name them
    script, argv = tiny_argv(command, names, tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("the quick fox\n/stats\n"))  # --interactive: a turn, /stats
    if script == "-c":
        monkeypatch.chdir(REPO)
        exec(argv[0], {})
        assert "128K" in capsys.readouterr().out
        return
    main = {"generate.py": generate.main, "scripts/eval.py": ev.main, "scripts/quantize.py": quantize.main}[script]
    real = importlib.util.find_spec  # eval's tables without its plots (those: tests/test_eval.py)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    try:
        code = main(argv)
    except SystemExit as e:  # --help
        code = e.code
    out, err = capsys.readouterr()
    assert code == 0, err
    if script == "scripts/eval.py":
        assert json.loads((tmp_path / "eval" / "results.json").read_text())["records"]
    elif script == "scripts/quantize.py":
        assert (tmp_path / "quantized" / "budgetkv.safetensors").is_file()
    elif "--help" in argv:  # every flag, or the policy's own help
        assert out.startswith(f"{argv[argv.index('--policy') + 1]}:") if "--policy" in argv else "--budget" in out
    else:  # the summary (--json: its object; --interactive: a turn's)
        assert re.search(r"\d+ generated|\"generated_tokens\"| held", out + err), out + err


def test_the_readmes_python_api_runs_as_written(tmp_path):
    """README's Python API blocks, in order, in one fresh process from the repository root, on the embedded model at
    a tiny size (max_new_tokens 8; no compile, which tests/test_aoti.py covers): every call succeeds."""
    import subprocess
    text = (REPO / "README.md").read_text()
    api = text[text.index("## Python API"):text.index("## Adding a policy")]
    code = "\n".join(re.findall(r"```python\n(.*?)```", api, re.S))
    assert "generate_text" in code and "Generation" in code and "Chat(" in code
    assert not re.search(r"^\s*(import|from) torch\b", code, re.M)  # torch first undid the threads' choice (issue 55)
    code = code.replace("max_new_tokens=100", "max_new_tokens=8").replace("compile=True", "compile=False")
    code = code.replace("run.compile(model, ids[0][0])", "pass")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout

"""Every command the README and the docs/ pages show runs here, at the shapes it shows (compile-only
where a run would be large), so a documented command cannot break unseen: `COMMANDS` says how each
one is run, and a command added to README.md or a docs/ page without an entry here fails
`test_every_readme_command_is_run`. A command shown on several pages is one entry, run once.

How a command runs (the value in COMMANDS):
- "tiny": in a scratch directory standing for the repository's working directory, one after the
  other (the default job, then generate/evaluate/plot/export/import on its `runs/tiny`). The
  default job stops at step 40 with `--config.train.stop_at_step` (the same shapes and schedule);
  the other "tiny" training commands run (2 steps each, into their own run_dirs) with `-m slow`;
- "compile": the train command's config, parsed as the command line parses it, built and its train
  step compiled from abstract shapes (nothing is allocated): the zoo's shapes compile on emulated
  CPU devices (the multi-process launcher and the SLURM template start this same program; their own
  mechanics: tests/test_multihost.py, tests/test_launch.py);
- "tool": the tool's `main` with the README's arguments (outputs that would land in the repository
  go to the scratch directory instead);
- "test_x.py::test_y": run by that test (its file must hold it), e.g. the export commands on runs the
  README does not make.
"""

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "pip install -e . && python -m boost_jax.train": "tiny",
    "pip install -e '.[test]' && pytest": "the suite itself (.ci/run)",
    "python benchmarks/first_command.py": "test_first_hour.py::test_first_command_benchmark",
    "python -m boost_jax.train --config configs/cola_60m.py --config.data.path=/data/c4_tok "
    "--config.data.eval_path=/data/c4_val_tok --config.run_dir=runs/cola_60m_c4": "compile",
    "python -m boost_jax.data.prepare /data/c4/en/c4-train.*.json.gz --out /data/c4_tok --tokenizer t5.model": "tool",
    "python -m boost_jax.data.prepare /data/c4/en/c4-validation.*.json.gz --out /data/c4_val_tok "
    "--tokenizer t5.model": "tool",
    "python -m boost_jax.train --config configs/cola_60m.py --config.data.path=/data/c4_tok "
    "--config.data.eval_path=/data/c4_val_tok --config.data.tokenizer=t5.model": "compile",
    "python -m boost_jax.train --config configs/llama_60m.py --config.data.path=/data/c4_tok "
    "--config.data.eval_path=/data/c4_val_tok --config.data.tokenizer=t5.model": "compile",
    "python -m boost_jax.evaluate --checkpoint runs/cola_60m --eval-tokens 10000000": "test_evaluate.py::test_eval_tokens_reads_documents_the_paper_way",
    "python -m boost_jax.train --config.train.steps=1000 --config.model.linear=dense "
    "--config.run_dir=runs/tiny_dense": "tiny",
    "python -m boost_jax.train --config cola_60m --config.data.source=embedded --config.model.vocab_size=256 "
    "--config.train.steps=20 --config.train.warmup_steps=2 --config.train.global_batch=8 "
    "--config.train.eval_tokens=0 --config.train.eval_batches=1 --config.run_dir=runs/cola_60m_cpu": "test_readme.py::test_zoo_short_run_on_a_cpu_starts_clean_and_compiles",
    'python -m boost_jax.generate --checkpoint runs/tiny --prompt "def main(" --max_new_tokens 200': "tiny",
    "python -m boost_jax.data.prepare /data/c4/*.json.gz --out /data/c4_tok --tokenizer t5.model": "tool",
    "python -m boost_jax.tools.shardings --config configs/tt_1b.py": "tool",
    "python benchmarks/grad_reduce.py --pipeline": "tool",
    "python -m boost_jax.tools.comm_report --config configs/cola_7b.py --mesh 1,1,4 "
    "--strategy btp,vanilla,megatron": "tool",
    "python -m boost_jax.tools.shardings --config configs/cola_1b.py --mesh 1,1,8 --strategy btp": "tool",
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m boost_jax.train --config.parallel.context=2 "
    "--config.parallel.tensor=2 --config.parallel.data=2 --config.run_dir=runs/tiny_cp": "tiny",
    "python -m boost_jax.tools.comm_report --config configs/tiny.py --mesh 1,1,1,2,2 --strategy btp --batch 4 "
    "--seq 64 --no-memory": "test_context.py::test_comm_report_cli_shows_the_context_exchange",
    "launch/local_multiprocess.sh 2 --config.parallel.data=2 --config.parallel.tensor=4 "
    "--config.run_dir=runs/tiny_2proc": "compile",
    "sbatch --nodes=4 launch/slurm/train.sbatch configs/cola_1b.py --config.data.path=...": "compile",
    "python -m boost_jax.evaluate --checkpoint runs/tiny": "tiny",
    "python -m boost_jax.tools.plot runs/tiny": "tiny",
    "python -m boost_jax.xla_gpu_flags --explain": "tool",
    "pip install -e '.[hf]'": "the test extras install safetensors (tests/test_export.py)",
    "pip install -e '.[tokenizers]'": "the test extras install tokenizers and sentencepiece (tests/test_data.py)",
    "python -m boost_jax.train --help": "test_cli.py::test_help_lists_every_key_with_default_and_meaning",
    "python -m boost_jax.train --config cola_60m --print_config": "test_cli.py::test_print_config_shows_the_resolved_config",
    "python -m boost_jax.export --checkpoint runs/llama_tiny --out hf/llama_tiny": "test_export.py::test_dense_export_import_is_bit_identical",
    "python -m boost_jax.export --import-hf hf/llama_tiny --out runs/imported": "test_export.py::test_dense_export_import_is_bit_identical",
    "python -m boost_jax.export --checkpoint runs/tiny --out hf/cola_tiny": "tiny",
    "python -m boost_jax.export --import-hf hf/cola_1b --out runs/cola_1b --intermediate-multiple 32": "test_export.py::test_intermediate_padding_is_inert",
    "python -m boost_jax.generate --checkpoint runs/imported": "tiny",
    "python -m boost_jax.plan --config configs/cola_7b.py --devices 32 --cluster configs/clusters/a100_4x.py": "tool",
    "python -m boost_jax.plan --config configs/cola_13b.py --devices 64 --cluster configs/clusters/h100_8x.py "
    "--batch 4 --seq 32768 --top 3": "test_planner_context.py::test_readme_context_plan",
    "pip install -e '.[aot]'": "the aot extra: .ci/run installs it (tests/test_aot.py)",
    "python -m boost_jax.tools.aot --target h100 --devices 8 --config configs/cola_1b.py --mesh 1,1,8,1 --train-only": "test_aot.py::test_readme_commands",
    "python -m boost_jax.plan --config configs/cola_7b.py --devices 8 --cluster configs/clusters/h100_8x.py --verify "
    "--target h100": "test_aot.py::test_readme_commands",
    "python benchmarks/aot_fit.py --smallest": "test_aot.py::test_aot_fit_readme_command",
    "python benchmarks/tp7b.py": "test_planner_time.py::test_the_tp7b_command",
    "python benchmarks/boost_table.py": "test_boost_table.py::test_the_table_and_its_speedups_come_from_the_rows",
    "python benchmarks/boost_table.py --target h100": "test_boost_table.py::test_the_table_and_its_speedups_come_from_the_rows",
    "python -m boost_jax.tools.aot --target a100_40gb --devices 2 --config configs/cola_3b.py --mesh 1,1,2 --train-only "
    "--profile --config.parallel.strategy=btp --config.train.seq_len=4096 --config.train.global_batch=4 "
    "--config.train.grad_accum=4 --config.remat.policy=none --config.model.max_seq_len=4096 "
    "--json benchmarks/boost_table/cola_3b_btp_a100_40gb.json": "test_boost_table.py::test_the_recording_command",
    "python benchmarks/gpu_bench.py --parts device,train256 --one-process --profile gpu_profile": "test_benchmarks_smoke.py::test_gpu_bench_train256_one_process_profile",
    "python benchmarks/vs_torch.py --cola-repo /path/to/CoLA": "test_benchmarks_smoke.py::test_vs_torch",
    "python benchmarks/aot_fit.py --fixed": "test_aot.py::test_aot_fit_fixed_plans_within_10_percent",
    "python benchmarks/aot_fit.py --target a100_40gb --cluster configs/clusters/a100_4x.py": "test_aot.py::test_aot_fit_a100_readme_command",
    "python -m boost_jax.tools.aot --target h100 --devices 1 --config configs/cola_1b.py --mesh 1,1,1,1 --train-only "
    "--profile --config.train.seq_len=256 --config.train.global_batch=32 --config.data.batching=stream": "test_step_profile.py::test_readme_profile_command",
    "python benchmarks/step_profile_fit.py --check": "test_step_profile.py::test_every_measured_h100_row_within_15_percent",
    'python benchmarks/step_profile_trace.py --out DIR --rows "cola_1b auto 256"': "test_step_profile.py::test_trace_script_on_this_host",
    "python -m boost_jax.tools.step_profile --hlo NAME.hlo.gz --events NAME.events.json": "test_step_profile.py::test_trace_script_on_this_host",
    "python benchmarks/planner_time_fit.py": "test_planner_time.py::test_the_readme_command",
    "python -m boost_jax.train --config configs/cola_1b.py --config.parallel.plan=auto --config.data.path=/data/c4_tok "
    "--config.data.eval_path=/data/c4_val_tok --config.run_dir=runs/cola_1b_auto": "test_plan_auto.py::test_readme_command",
}


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the README's commands first


def commands_in(page: Path) -> list[str]:
    """Each line of a page's bash blocks, and each inline `python -m MODULE ARGS...`,
    `python benchmarks/...`, `launch/...` or `sbatch ...` span (a bare `python -m MODULE` names a
    command in prose; the full lines show how to run it)."""
    text = page.read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(re.sub(r"\s+#.*$", "", line).split())
            if line:
                out.append(line)
    prose = re.sub(r"\s*\n\s*", " ", re.sub(r"```.*?```", "", text, flags=re.S))
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if re.match(r"python -m \S+ \S|python benchmarks/\S+|launch/\S+\.sh|sbatch ", span):
            out.append(span)
    return list(dict.fromkeys(out))


def readme_commands() -> list[str]:
    """The commands README.md and then the docs/ pages show, each once, in that order (a reader
    follows the README first)."""
    return list(dict.fromkeys(c for page in DOC_PAGES for c in commands_in(page)))


def test_every_readme_command_is_run():
    for page in DOC_PAGES:
        missing = [c for c in commands_in(page) if c not in COMMANDS]
        where = page.relative_to(ROOT)
        assert not missing, f"{where}: commands no test runs (add them to tests/test_readme.py COMMANDS): {missing}"
    shown = readme_commands()
    stale = [c for c in COMMANDS if c not in shown]
    assert not stale, f"COMMANDS entries neither the README nor docs/ shows: {stale}"
    for how in COMMANDS.values():  # a referenced test must exist where it is named
        if "::" in how:
            file, name = how.split("::")
            assert f"def {name}(" in (ROOT / "tests" / file).read_text(), how


def _argv(command: str) -> list[str]:
    """The command's words, without the `NAME=VALUE` environment settings in front (the suite's
    conftest emulates 8 CPU devices, as the README's XLA_FLAGS do)."""
    import shlex

    words = shlex.split(command.split(" && ")[-1])
    while words and re.match(r"[A-Z_]+=", words[0]):
        words = words[1:]
    return words


# ---------------------------------------------------------------- "tiny": the default job and its runs/tiny


def trains(command: str) -> bool:
    """Whether a README command starts the trainer (not only its --help or --print_config)."""
    return bool(re.search(r"boost_jax\.train|local_multiprocess\.sh|train\.sbatch", command)) and not re.search(
        r"--help|--print_config", command
    )


def test_each_readme_training_command_has_its_own_run_dir(monkeypatch):
    """Run one after the other in one directory, as a reader follows the README, no training command
    may find an earlier one's run: it would resume it (a finished one: "the run is complete", nothing
    trained) or refuse its config."""
    from boost_jax import train

    monkeypatch.chdir(ROOT)  # the config paths are the repository's
    seen = {}
    for command in filter(trains, readme_commands()):
        run_dir = train.parse_config(_train_argv(command)).run_dir
        assert run_dir not in seen, f"{command!r} writes {run_dir}, as {seen.get(run_dir)!r} before it does"
        seen[run_dir] = command


def _train_tiny(cwd, command: str, stop: int) -> None:
    """`command` run in `cwd` until step `stop` (no evaluations but the default job's), as a new run."""
    from boost_jax import train

    argv = [*_train_argv(command), f"--config.train.stop_at_step={stop}", "--config.train.progress=false"]
    argv += [] if command.endswith("boost_jax.train") else ["--config.train.eval_every=0"]
    cfg = train.parse_config(argv)
    assert not (cwd / cfg.run_dir).exists(), f"{command}: {cfg.run_dir} is an earlier command's run"
    summary = train.run(cfg)
    assert summary["step"] == stop and summary["last_checkpoint_step"] == stop, command


TINY_TRAINING = [c for c in readme_commands() if COMMANDS.get(c) == "tiny" and trains(c)]
DEFAULT_JOB = next(c for c in TINY_TRAINING if c.endswith("boost_jax.train"))


@pytest.fixture(scope="module")
def tiny_cwd(tmp_path_factory):
    """A working directory where the README's default job has run (stopped at step 40) into runs/tiny."""
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        _train_tiny(cwd, DEFAULT_JOB, 40)
    return cwd


@pytest.mark.slow  # each compiles its own mesh's step (the suite's time)
@pytest.mark.parametrize(
    "command", [c for c in TINY_TRAINING if c != DEFAULT_JOB], ids=lambda c: c.rpartition("run_dir=")[2]
)
def test_the_other_tiny_training_commands(tmp_path, monkeypatch, command):
    """The README's other "tiny" training commands (context parallelism on 8 emulated devices, the dense
    twin), 2 steps each into the run_dir each names."""
    monkeypatch.chdir(tmp_path)
    _train_tiny(tmp_path, command, 2)


def _in(cwd, monkeypatch, command: str, main) -> None:
    monkeypatch.chdir(cwd)
    assert main(_argv(command)[3:]) in (0, None), command


def test_tiny_generate_evaluate_plot(tiny_cwd, monkeypatch, capsys):
    from boost_jax import evaluate, generate
    from boost_jax.tools import plot

    _in(
        tiny_cwd,
        monkeypatch,
        'python -m boost_jax.generate --checkpoint runs/tiny --prompt "def main(" --max_new_tokens 200',
        generate.main,
    )
    assert capsys.readouterr().out.startswith("def main(")
    _in(tiny_cwd, monkeypatch, "python -m boost_jax.evaluate --checkpoint runs/tiny", evaluate.main)
    assert "perplexity" in capsys.readouterr().out
    _in(tiny_cwd, monkeypatch, "python -m boost_jax.tools.plot runs/tiny", plot.main)
    assert list((tiny_cwd / "runs" / "tiny").glob("*.png"))


def test_tiny_export_import_generate(tiny_cwd, monkeypatch, capsys):
    pytest.importorskip("safetensors")
    from boost_jax import export, generate

    _in(tiny_cwd, monkeypatch, "python -m boost_jax.export --checkpoint runs/tiny --out hf/cola_tiny", export.main)
    assert (tiny_cwd / "hf" / "cola_tiny" / "model.safetensors").is_file()
    # The export given to generate (a run's tool) points at the import.
    capsys.readouterr()
    assert generate.main(["--checkpoint", "hf/cola_tiny"]) == 1
    assert capsys.readouterr().err == (
        f"error: --checkpoint: {tiny_cwd / 'hf' / 'cola_tiny'} holds a Hugging Face model (safetensors), not a "
        f"run's checkpoints; import it first: python -m boost_jax.export --import-hf {tiny_cwd / 'hf' / 'cola_tiny'} "
        "--out runs/NAME, then --checkpoint runs/NAME\n"
    )
    # The import the README shows for its CoLA export, then its generate command on the import.
    assert export.main(["--import-hf", "hf/cola_tiny", "--out", "runs/imported"]) == 0
    capsys.readouterr()
    _in(tiny_cwd, monkeypatch, "python -m boost_jax.generate --checkpoint runs/imported", generate.main)
    assert capsys.readouterr().out.startswith("def ")


# ---------------------------------------------------------------- "compile": train commands at their shapes

COMPILE = [c for c, how in COMMANDS.items() if how == "compile"]


def _train_argv(command: str) -> list[str]:
    """The `python -m boost_jax.train` argv a command starts (the launchers pass theirs through)."""
    args = _argv(command)
    if args[0] == "sbatch":  # train.sbatch CONFIG FLAGS...
        return ["train", "--config", args[3], *args[4:]]
    if args[0].endswith("local_multiprocess.sh"):  # N FLAGS...: N processes, one mesh over all their devices
        return ["train", *args[2:]]
    return ["train", *args[3:]]


@pytest.mark.parametrize("command", COMPILE, ids=lambda c: re.sub(r"\W+", "_", c)[:60])
def test_train_commands_compile_at_their_shapes(command, tmp_path, monkeypatch):
    from boost_jax import train
    from boost_jax.runtime.build import build

    monkeypatch.chdir(ROOT)  # the config paths are the repository's
    cfg = train.parse_config(_train_argv(command))
    compiled = build(cfg).lower_train().compile()
    assert compiled.memory_analysis() is not None


def test_zoo_short_run_on_a_cpu_starts_clean_and_compiles(tmp_path, monkeypatch, capsys):
    """The README's short CPU try of a zoo config: everything the trainer checks before it compiles
    (the config, the data, the held-out split against the evaluation) passes without an error, a
    warning or a note, and its train step compiles at its shapes (20 steps of the 10M-parameter model
    would take minutes on the suite's CPUs)."""
    from boost_jax import train
    from boost_jax.runtime.build import build

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    command = next(c for c in COMMANDS if "cola_60m_cpu" in c)
    monkeypatch.chdir(tmp_path)
    cfg = train.parse_config(_train_argv(command))
    monkeypatch.setattr(train, "_restore_or_init", started)  # where the state is initialised (compiled)
    with pytest.raises(Started):
        train.run(cfg)
    out = capsys.readouterr()
    assert not re.search(r"warning|note|error", out.out + out.err), out
    assert "cola_60m: cola model, 10.27M parameters" in out.out and "20 steps" in out.out
    assert build(cfg).lower_train().compile().memory_analysis() is not None


# ---------------------------------------------------------------- "tool"


@pytest.mark.slow  # ~2 min: three 7B strategies compiled at 1 and 2 layers
def test_comm_report_7b(capsys):
    from boost_jax.tools.comm_report import command as comm_report

    rep = comm_report.main(
        _argv(
            "python -m boost_jax.tools.comm_report --config configs/cola_7b.py --mesh 1,1,4 "
            "--strategy btp,vanilla,megatron"
        )[3:]
    )
    btp = rep["strategies"]["btp"]["per_layer_forward"]["tensor"]["elements_per_token"]
    assert abs(btp - 7 * 1024) <= 0.01 * 7 * 1024  # 7r per token per layer forward (r = 1024)
    assert "| fwd / layer, tensor: elements/token |" in capsys.readouterr().out


@pytest.mark.parametrize("command", [c for c in COMMANDS if "tools.shardings" in c])
def test_shardings(command, capsys):
    from boost_jax.tools import shardings

    shardings.main(_argv(command)[3:])
    assert "PartitionSpec" in capsys.readouterr().out


@pytest.mark.slow  # ~40 s cold: the README's 7B plan search
def test_plan_and_xla_flags(capsys):
    from boost_jax import plan, xla_gpu_flags

    assert plan.main(_argv(next(c for c in COMMANDS if "boost_jax.plan" in c))[3:]) == 0
    out = capsys.readouterr().out
    assert "run it with:" in out and "layouts: R replicated" in out  # the legend of the layout codes
    assert xla_gpu_flags.main(["--explain"]) == 0
    assert "--xla_gpu_enable_latency_hiding_scheduler" in capsys.readouterr().out


@pytest.mark.slow  # ~1.5 min: the benchmark's pipeline meshes compiled
def test_grad_reduce_pipeline_matches_its_committed_json(tmp_path):
    """`python benchmarks/grad_reduce.py --pipeline`, writing to the scratch directory: the numbers the
    README and benchmarks/RESULTS.md quote (benchmarks/grad_reduce_pipeline.json) are today's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grad_reduce_bench", ROOT / "benchmarks" / "grad_reduce.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--pipeline", "--json", str(tmp_path / "grad_reduce.json")]) == 0
    got = json.loads((tmp_path / "grad_reduce_pipeline.json").read_text())
    committed = json.loads((ROOT / "benchmarks" / "grad_reduce_pipeline.json").read_text())
    assert [r["executed_elements"] for r in got["rows"]] == [r["executed_elements"] for r in committed["rows"]]
    assert got["accumulation"] == committed["accumulation"]


@pytest.fixture(scope="module")
def c4_like(tmp_path_factory):
    """A small C4-like corpus (gzipped JSONL shards under data/c4 and data/c4/en, train and validation)
    and a SentencePiece model `t5.model`, standing in for /data/c4 and T5's tokenizer."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("c4")
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(300)]
    docs = [" ".join(rng.choice(words, rng.integers(5, 120))) for _ in range(300)]
    shards = {
        "data/c4/c4-train.{k:05d}.json.gz": docs[:200],
        "data/c4/en/c4-train.{k:05d}-of-01024.json.gz": docs[:240],
        "data/c4/en/c4-validation.{k:05d}-of-00008.json.gz": docs[240:],
    }
    for pattern, part in shards.items():
        for k in range(2):
            path = root / pattern.format(k=k)
            path.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(path, "wt") as f:
                for d in part[k::2]:
                    f.write(json.dumps({"text": d}) + "\n")
    (root / "corpus.txt").write_text("\n".join(docs))
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(root / "t5"), vocab_size=64, hard_vocab_limit=False
    )
    return root, {
        pattern.split("/")[-1].split(".")[0] + ("_en" if "/en/" in pattern else ""): len(part)
        for pattern, part in shards.items()
    }


def _local(command: str, root) -> list[str]:
    """A command's arguments with /data/ under `root` and its globs expanded as the shell would."""
    import glob

    argv = [a.replace("/data/", str(root) + "/data/") for a in _argv(command)]
    return [x for a in argv for x in (sorted(glob.glob(a)) if "*" in a else [a])]


@pytest.mark.parametrize("command", [c for c in COMMANDS if "data.prepare" in c], ids=lambda c: c.split()[3])
def test_prepare_c4_like_jsonl_with_a_sentencepiece_model(command, c4_like, monkeypatch):
    """Each data.prepare command the README shows, on the C4-like corpus: every document, its
    boundaries recorded."""
    import shutil

    from boost_jax.data import prepare

    root, counts = c4_like
    monkeypatch.chdir(root)
    argv = _local(command, root)[3:]
    shutil.rmtree(argv[argv.index("--out") + 1], ignore_errors=True)  # two commands share /data/c4_tok
    assert prepare.main(argv) == 0
    index = json.loads((Path(argv[argv.index("--out") + 1]) / "index.json").read_text())
    split = "c4-validation_en" if "validation" in command else "c4-train_en" if "/en/" in command else "c4-train"
    assert index["documents"] == counts[split] and index["tokens"] > counts[split]
    assert all(shard["ends"] for shard in index["shards"])


def test_reproduce_cola_60m_batches_are_documents(c4_like, monkeypatch):
    """The README's cola_60m command on the prepared corpus: one document per row, its first 256
    tokens, padding after it; the eval split is the validation directory."""
    from boost_jax import train
    from boost_jax.data import build_loaders
    from boost_jax.data.prepare import main as prepare_main

    root, counts = c4_like
    monkeypatch.chdir(root)
    import shutil

    for command in [c for c in COMMANDS if "data.prepare /data/c4/en" in c]:
        argv = _local(command, root)[3:]
        shutil.rmtree(argv[argv.index("--out") + 1], ignore_errors=True)
        assert prepare_main(argv) == 0
    command = next(c for c in COMMANDS if "cola_60m.py" in c and "t5.model" in c)
    monkeypatch.chdir(ROOT)
    cfg = train.parse_config(["train", *_local(command, root)[3:]])
    cfg.data.tokenizer = str(root / "t5.model")
    assert cfg.data.batching == "document" and cfg.train.eval_tokens == 10_000_000
    tr, ev, _ = build_loaders(cfg)
    assert (tr.n, ev.n) == (counts["c4-train_en"], counts["c4-validation_en"])
    batch = tr.batch(0)
    assert batch["tokens"].shape == (512, 257) and (batch["lengths"] <= 256).all()
    for row, n in zip(batch["tokens"], batch["lengths"]):
        assert (row[n:] == 0).all() and n > 0

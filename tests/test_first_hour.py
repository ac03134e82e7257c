"""What a new user meets in the first hour, beyond `--help` (tests/test_cli.py): overrides in any
order around `--config`, absl's help flags and parse errors answered with ours, `--help` into a pipe
that closes early, a progress bar whose time left does not count the compile, a rerun of a finished
run that says so, install hints that fit how the package was installed, and the mesh error's hint
for emulating devices."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boost_jax import train, xla_gpu_flags
from boost_jax.runtime.build import build as real_build

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's boost_jax in the commands started


def test_overrides_before_the_config_apply_to_it():
    for argv in (
        ["train", "--config.train.steps=3", "--config", "cola_60m", "--config.train.lr=0.5"],
        ["train", "--config.train.lr=0.5", "--config.train.steps=3", "--config=cola_60m"],
    ):
        cfg = train.parse_config(argv)
        assert (cfg.name, cfg.train.steps, cfg.train.lr, cfg.data.batching) == ("cola_60m", 3, 0.5, "document"), argv


@pytest.mark.parametrize("flag", ["--helpshort", "--helpfull", "--helpxml"])
def test_absls_help_flags_print_ours(flag, capsys):
    assert train.main(["train", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(train.USAGE.splitlines()[0]) and "--config.train.steps=" in out
    assert "absl" not in out and "flags_parser" not in out


@pytest.mark.parametrize(
    "argv, needle", [(["train", "--steps=3"], "Unknown command line flag 'steps'"), (["train", "--config"], "--config")]
)
def test_a_flag_absl_cannot_parse_is_one_line_pointing_at_our_help(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_config(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "boost_jax.train --help" in err, err
    assert "helpshort" not in err


def test_help_into_a_closed_pipe_ends_quietly():
    """`boost-train --help | head -1`: the reader is gone before the help is written."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run(
        [sys.executable, "-m", "boost_jax.train", "--help"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        env=ENV,
    )
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_a_flag_absl_cannot_parse_on_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "boost_jax.train", "--config.train.steps=2", "--steps=3"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "Unknown command line flag 'steps'" in proc.stderr and "helpshort" not in proc.stderr


def test_the_time_left_does_not_count_the_compile(make_config, tmp_path, capsys):
    """The first step waits for the compile (here: 2 s); the next ones take ~10 ms. The bar's rate and
    time left come from those, and a line says what the first step took."""
    from boost_jax.runtime.report import Reporter

    cfg = make_config()
    cfg.train.update(steps=400, progress=True)
    rep = Reporter(
        tmp_path,
        name=cfg.name,
        steps=cfg.train.steps,
        tokens_per_step=cfg.train.global_batch * cfg.train.seq_len,
        progress=cfg.train.progress,
        main_process=True,
        flops_per_token=1.0,
    )
    rep.start_bar(0)
    time.sleep(2.0)  # the compile
    rep.step_done()
    start = time.perf_counter()
    for _ in range(5):
        time.sleep(0.01)
        rep.step_done()
    per_step = (time.perf_counter() - start) / 5  # what the steps after the compile took (a loaded machine: more)
    info = rep.bar.format_dict
    rate = info["rate"] or (info["n"] - info["initial"]) / info["elapsed"]
    left = (info["total"] - info["n"]) / rate
    rep.close()
    assert info["n"] == 6 and left < 3 * 394 * per_step + 1, (info, left, per_step)  # counting the compile: >= 400 s
    out = capsys.readouterr().out
    took = re.search(r"step 1 took (\d+\.\d) s with the compile", out)
    assert took and float(took.group(1)) >= 2.0, out


def test_rerunning_a_finished_run_says_it_is_complete(make_config, capsys):
    cfg = make_config(**{"train.steps": 2, "train.eval_every": 0})
    assert train.run(cfg)["step"] == 2
    capsys.readouterr()
    cfg.train.progress = True
    summary = train.run(cfg)
    out, err = capsys.readouterr()
    assert summary["step"] == 2 and "the run is complete: step 2 of 2" in out and "--config.train.steps" in out
    assert "compiling" not in out and "step/s" not in err and "s/step" not in err, err  # no progress bar
    cfg.train.update(steps=8, stop_at_step=2)
    train.run(cfg)
    assert "at or past --config.train.stop_at_step=2" in capsys.readouterr().out


def test_a_mesh_larger_than_the_machine_says_how_to_emulate_it():
    """The README's context example on one CPU device: the error names every axis that may be -1 and
    the XLA_FLAGS that emulate the devices it asks for."""
    import jax

    from boost_jax.errors import ConfigError
    from boost_jax.parallel.mesh import make_mesh

    cfg = train.parse_config(
        ["train", "--config.parallel.context=2", "--config.parallel.tensor=2", "--config.parallel.data=2"]
    )
    with pytest.raises(ConfigError) as e:
        make_mesh(cfg.parallel, jax.devices()[:1])
    text = str(e.value)
    assert "JAX sees 1 device;" in text and "pipeline/data/fsdp/context/tensor to -1" in text, text
    assert text.endswith("XLA_FLAGS=--xla_force_host_platform_device_count=8"), text


def test_install_hints_fit_how_the_package_was_installed(tmp_path):
    """From a checkout: an editable install of that checkout, by its path (it works from any
    directory); from an installed wheel: the extra's own requirements, from the package metadata."""
    from boost_jax.errors import install_hint

    assert install_hint("hf") == f"pip install -e '{ROOT}[hf]'"
    site = tmp_path / "site-packages" / "boost_jax"  # what a wheel installs: no pyproject.toml above it
    site.mkdir(parents=True)
    hint = install_hint("hf", package_dir=site)
    assert hint.startswith("pip install 'safetensors") and "-e" not in hint and "[hf]" not in hint, hint
    aot = install_hint("aot", package_dir=site)
    assert "'jax-cuda13-plugin" in aot and "'nvidia-cudnn-cu13" in aot, aot


def test_ticking_shows_a_long_step_is_alive():
    """Past `after` seconds, the step's name and elapsed time, then how long it took; a shorter step
    prints nothing, and one that fails nothing after its progress (the command's error is the last line)."""
    import io

    from boost_jax.tools.progress import ticking

    out = io.StringIO()
    with ticking("plan: searching", after=0.05, every=0.05, file=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "plan: searching: done in 0:00" and len(lines) >= 3, lines
    assert all(ln == "plan: searching... 0:00" for ln in lines[:-1]), lines
    out = io.StringIO()
    with ticking("plan: searching", after=10, file=out):
        time.sleep(0.05)
    assert out.getvalue() == ""
    out = io.StringIO()
    with pytest.raises(ValueError), ticking("plan: searching", after=0.05, every=10, file=out):
        time.sleep(0.2)
        raise ValueError("the command's one-line error says what happened")
    assert out.getvalue() == "plan: searching... 0:00\n"


def test_plan_speaks_before_it_searches(monkeypatch, capsys):
    """`plan` prints the model and cluster line, and that it is searching, before the search (which
    takes minutes for the README's larger commands)."""
    from boost_jax import plan

    seen = {}

    def search(*args, **kwargs):
        seen["out"], seen["err"] = capsys.readouterr()
        raise ValueError("stopped here by the test")

    monkeypatch.setattr(plan, "search", search)  # the name plan.py calls
    with pytest.raises(SystemExit, match="stopped here by the test"):
        plan.main(
            [
                "--config",
                str(ROOT / "configs" / "cola_7b.py"),
                "--devices",
                "32",
                "--cluster",
                str(ROOT / "configs" / "clusters" / "a100_4x.py"),
            ]
        )
    assert seen["out"].startswith("cola_7b (cola,") and "on 32 GPUs" in seen["out"], seen
    assert seen["err"] == "", seen  # the search's progress starts after 5 s


def test_first_command_benchmark(tmp_path, capsys):
    """`python benchmarks/first_command.py` (the README's timing of its first command), on a short
    schedule: the table and JSON hold wall and CPU time, the first step's time with the compile, the
    time left shown at the first log point beside what the rest took, and the load average."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("first_command", ROOT / "benchmarks" / "first_command.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "first.json"
    assert (
        bench.main(
            [
                "--json",
                str(out),
                "--",
                "--config.train.steps=6",
                "--config.train.warmup_steps=1",
                "--config.train.log_every=2",
                "--config.train.eval_every=0",
            ]
        )
        == 0
    )
    row = __import__("json").loads(out.read_text())
    assert row["wall_s"] > row["first_step_s"] > 0 and row["cpu_s"] > 0, row
    assert row["bar_at_first_log"]["step"] == 2 and row["bar_at_first_log"]["time_left_shown_s"] is not None, row
    assert row["load_avg"]["max"] >= row["load_avg"]["min"] >= 0
    assert "| first step (with the compile) |" in capsys.readouterr().out


@pytest.mark.skipif(
    not xla_gpu_flags.plugin_without_gpu() or os.environ.get("JAX_PLATFORMS", "cpu") != "cpu",
    reason="needs a CUDA plugin of jax (the aot extra) on a host without an NVIDIA driver",
)
def test_no_gpu_plugin_noise_on_a_host_without_a_gpu(tmp_path):
    """With the `aot` extra's CUDA plugin installed on a host without a GPU, JAX logs a 17-line
    "Jax plugin configuration error ... Unable to load cuFFT" traceback when it starts its backends:
    the entry points keep it from the user (run as a user runs them, JAX_PLATFORMS unset; an empty
    --checkpoint directory is looked up by Orbax, which starts them, then refused)."""
    env = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}
    commands = (
        ["boost_jax.train", "--print_config"],
        ["boost_jax.evaluate", "--checkpoint", str(tmp_path)],
        ["boost_jax.generate", "--checkpoint", str(tmp_path)],
    )
    procs = [
        subprocess.Popen([sys.executable, "-m", *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for c in commands
    ]
    for command, proc in zip(commands, procs):
        _, err = proc.communicate(timeout=300)
        expected = (
            "" if command[0] == "boost_jax.train" else f"error: --checkpoint: no checkpoint found in {tmp_path}\n"
        )
        assert err == expected, (command, err)


def _reporter(run_dir, steps=400):
    from boost_jax.runtime.report import Reporter

    return Reporter(
        run_dir, name="tiny", steps=steps, tokens_per_step=1, progress=True, main_process=True, flops_per_token=1.0
    )


def test_the_bar_counts_each_step_when_the_device_has_finished_it(make_config, monkeypatch):
    """With log_every above the run's steps, the bar still moves with the steps: the loop counts a
    step when its results are ready (each step here takes 50 ms longer than its dispatch), not when
    it was dispatched (the bar would race ahead, then sit until the log point)."""
    import dataclasses

    import jax

    from boost_jax.parallel.mesh import ONE_DEVICE
    from boost_jax.runtime import report

    cfg = make_config(**{"train.steps": 6, "train.log_every": 50, "train.eval_every": 0, "checkpoint.every": 50})
    cfg.parallel.update(ONE_DEVICE, num_devices=1)
    slow = jax.jit(
        lambda x: jax.pure_callback(lambda v: (time.sleep(0.05), v)[1], jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    )
    dispatched, counted = [], []
    real_done = report.Reporter.step_done

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)

        def delayed(state, batch, step=built.train_step):
            state, metrics = step(state, batch)
            metrics = {**metrics, "loss": slow(metrics["loss"])}
            dispatched.append(metrics["loss"])
            return state, metrics

        return dataclasses.replace(built, train_step=delayed)

    def step_done(self):
        counted.append(dispatched[len(counted)].is_ready())
        real_done(self)

    monkeypatch.setattr(train, "build", build)
    monkeypatch.setattr(report.Reporter, "step_done", step_done)
    assert train.run(cfg)["step"] == 6
    assert counted == [True] * 6, counted


def test_the_bar_redraws_after_a_burst_of_fast_steps(tmp_path, capsys):
    """A burst of steps between two redraws must not make tqdm wait for as many steps before each
    later redraw (its dynamic `miniters`): steps 0.15 s apart are each drawn."""
    rep = _reporter(tmp_path)
    rep.start_bar(0)
    rep.step_done()  # the compile
    for _ in range(30):
        rep.step_done()
    for _ in range(8):
        time.sleep(0.15)
        rep.step_done()
    rep.close()
    drawn = {int(n) for n in re.findall(r"(\d+)/400", capsys.readouterr().err)}
    assert set(range(32, 40)) <= drawn, sorted(drawn)


def test_the_bar_draws_in_a_terminal_of_size_0x0(tmp_path, monkeypatch):
    """A pseudo-terminal nobody sized reports 0 x 0: the bar is drawn 80 columns wide, not left empty."""
    import fcntl

    master, slave = os.openpty()  # a new pty's size is 0 x 0
    fcntl.fcntl(master, fcntl.F_SETFL, fcntl.fcntl(master, fcntl.F_GETFL) | os.O_NONBLOCK)
    term = os.fdopen(slave, "w")
    assert os.get_terminal_size(term.fileno()).columns == 0
    monkeypatch.setattr(sys, "stderr", term)
    rep = _reporter(tmp_path, steps=3)
    rep.start_bar(0)
    for _ in range(3):
        time.sleep(0.12)
        rep.step_done()
    rep.close()
    term.flush()
    shown = os.read(master, 1 << 16).decode(errors="replace")
    term.close()
    os.close(master)
    assert "tiny: 100%" in shown and "3/3" in shown, repr(shown)

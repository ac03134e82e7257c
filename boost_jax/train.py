"""Pre-train a model: `python -m boost_jax.train [--config configs/X.py] [--config.key=value ...]`.

Without flags it trains the tiny CoLA model on the embedded corpus on whatever devices JAX sees.
Read top-down: `run` (set-up), `_train` (build, restore, loop, finish), then the command line; the
loop is boost_jax/runtime/train_loop.py, what it settles before the loop boost_jax/runtime/train_startup.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
from pathlib import Path

import jax
from absl import logging as absl_logging

from boost_jax import xla_gpu_flags
from boost_jax.config import config_path, describe_config, load_config_file, packaged_configs
from boost_jax.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    RunDirBusy,
    TrainingDiverged,
    error_lines,
)
from boost_jax.model import autos, flops_per_token
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.planner.auto import fitting_plan
from boost_jax.runtime.build import build
from boost_jax.runtime.checkpoints.failures import cannot_write
from boost_jax.runtime.checkpoints.runlock import note_config_change, open_run_dir
from boost_jax.runtime.checkpoints.store import Checkpointer, restore
from boost_jax.runtime.distributed import maybe_initialize
from boost_jax.runtime.evaluation import EvalInterrupted, eval_loss
from boost_jax.runtime.report import Reporter
from boost_jax.runtime.signals import STOP_SIGNALS, StopFlag
from boost_jax.runtime.train_loop import TrainLoop, stop_requested
from boost_jax.runtime.train_startup import (
    check_data,
    complete_line,
    data_order,
    eval_plan,
    final_eval_cut,
    load_data,
    startup_line,
    use_compile_cache,
)
from boost_jax.tools.aot import peak_bytes
from boost_jax.validate import validate

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.py"  # packaged (a checkout: configs/)
ERRORS = (ConfigError, CheckpointError, TrainingDiverged, DistributedError, RunDirBusy, FileNotFoundError, ValueError)


def run(cfg, stop: StopFlag | None = None, config_file: str = "") -> dict:
    """Train per `cfg`; returns a summary (first/last eval loss, where things were written).

    SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 stop it with a checkpoint while it runs; the command
    line passes its own `stop`, installed for the whole process, so that signals arriving after the
    final save are absorbed too. `config_file`: where cfg came from, for the start-up line."""
    validate(cfg)
    xla_gpu_flags.quiet_gpu_plugin()
    gpu_flags, _ = xla_gpu_flags.apply() if cfg.xla_gpu_flags else ([], "")  # before JAX starts its backends
    maybe_initialize(cfg)  # before anything below asks JAX for devices (process_index does)
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save step at INFO
    main_process = jax.process_index() == 0
    say = print if main_process else (lambda *a, **k: None)
    if gpu_flags:
        say(
            f"XLA_FLAGS: added {len(gpu_flags)} GPU flags (boost_jax/xla_gpu_flags.py; xla_gpu_flags=false "
            "leaves XLA_FLAGS alone)"
        )
    use_compile_cache(cfg.compile_cache)
    planned = built = None
    if cfg.parallel.plan == "auto":
        cfg, planned, built = _auto_plan(cfg, say)
    with contextlib.nullcontext(stop) if stop is not None else StopFlag() as stop:
        run_dir, lock = open_run_dir(cfg.run_dir, main_process)
        try:
            return _train(cfg, run_dir, stop, say, config_file, planned, built)
        except OSError as e:  # a full disk or a read-only mount under run_dir: one line, not a traceback
            failure = cannot_write(e, run_dir / "checkpoints")
            if failure is None:
                raise
            raise failure from e
        finally:
            lock.release()


def _auto_plan(cfg, say):
    """parallel.plan=auto: (the config of the planner's best runnable plan whose compiled train step fits
    the devices this run uses (boost_jax/planner/auto.py fitting_plan), validated; the plan; its build,
    whose train step is the program compiled for the check)."""
    devices = mesh_devices(cfg.parallel)

    def peak(run):
        built = build(run, validated=True)  # the planner's pick of a validated config (tests/test_plan_auto.py)
        compiled = built.lower_train().compile()
        return peak_bytes(compiled.memory_analysis()), dataclasses.replace(built, train_step=compiled)

    def memory(cluster):
        return device_memory(cfg, devices[0], cluster)

    cfg, planned, built = fitting_plan(cfg, len(devices), devices[0].device_kind, peak, memory, say)
    return cfg, planned, built


def device_memory(cfg, device, cluster) -> tuple[float, str]:
    """(bytes per device a compiled parallel.plan=auto pick must fit, where the number comes from):
    parallel.device_memory_gb, else the device's allocator limit, else (CPUs report none) the cluster's
    usable HBM."""
    if cfg.parallel.device_memory_gb:
        return cfg.parallel.device_memory_gb * 1e9, "parallel.device_memory_gb"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return float(limit), "the device's allocator limit"
    return cluster.usable_hbm, f"{cluster.name}'s usable HBM; the device reports none"


def _train(cfg, run_dir: Path, stop: StopFlag, say, config_file: str = "", planned=None, built=None) -> dict:
    main_process = jax.process_index() == 0
    built = built or build(cfg, validated=True)  # `run` validated it before JAX started
    say(startup_line(cfg, built, config_file, planned))
    # The data, and what they make of the config (the eval split's size), before anything compiles.
    train_data, eval_data = load_data(cfg, built, cfg.data.shuffle)
    reading = eval_plan(cfg, eval_data, say)
    # This process group holds run_dir's lock: the checkpointer may clean up unfinished saves.
    ckpt = Checkpointer(
        run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save, owner=True
    )
    state, position, skipped, meta = _restore_or_init(cfg, built, ckpt, run_dir, say)
    order = data_order(cfg, meta, say)
    if order != cfg.data.shuffle:  # the checkpoint's position refers to another permutation of the samples
        train_data, eval_data = load_data(cfg, built, order)
    changed = check_data(cfg, meta, train_data, say)
    if main_process:
        (run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
    step = int(jax.device_get(state["step"]))
    t = cfg.train
    report = Reporter(
        run_dir,
        name=cfg.name,
        steps=t.steps,
        tokens_per_step=t.global_batch * t.seq_len,
        progress=t.progress,
        main_process=main_process,
        flops_per_token=flops_per_token(cfg.model, t.seq_len),
    )
    if planned is not None:  # what parallel.plan=auto ran, and what the planner predicted for it
        report.write(
            step,
            {
                "plan": "auto",
                "plan_overrides": planned.plan.overrides,
                "plan_cluster": planned.cluster_file,
                "planner_step_time_s": planned.plan.step_s,
                "planner_memory_gb": planned.plan.memory["total"] / 1e9,
            },
        )
    evaluate = _evaluator(built, eval_data, reading)
    stop.committed = ckpt.committed_step
    end = min(cfg.train.stop_at_step or cfg.train.steps, cfg.train.steps)
    if step >= end:
        say(complete_line(cfg, step, ckpt))
    else:
        say(
            "compiling the train and eval steps (the first step waits for it; --config.compile_cache=DIR "
            "keeps them for the next start)"
        )
    if step < end and cfg.train.eval_every:  # eval_every=0: no evaluation at all
        try:
            report.eval(step, evaluate(state["params"], stop=lambda: stop_requested(stop)), say=False)
        except EvalInterrupted:  # the loop's first step sees the signal: it saves and stops there
            say(f"{stop.signal or 'a signal'}: the evaluation at step {step} was stopped between batches")
    elif cfg.train.eval_every and final_eval_cut(meta, run_dir, step):
        say(f"the final evaluation (step {step}) was stopped before it finished when the run ended; running it now")
        try:
            result = evaluate(state["params"], stop=lambda: stop_requested(stop))
            report.eval(step, result, say=False)
            say(f"step {step}: eval loss {result['loss']:.4f} (CoLA's reported form {result['cola_loss']:.4f})")
        except EvalInterrupted:  # nothing to save: the checkpoint still says that this evaluation is due
            report.write(step, {"eval_stopped": 1})
            say(f"{stop.signal or 'a signal'}: the final evaluation was stopped again; a rerun runs it")
    loop = TrainLoop(
        cfg,
        built,
        ckpt,
        report,
        stop,
        train_data,
        evaluate,
        position,
        skipped,
        run_dir,
        order=order,
        tokens_seen=int(meta.get("tokens_seen", position * cfg.train.seq_len)),
        predicted_s=planned.plan.step_s if planned is not None else None,
    )
    if changed:
        report.write(step, {"data_changed": 1, "data_changed_sources": ", ".join(changed)})
    try:
        state, step = loop.run(state, step)
    finally:
        _close(loop, report, ckpt, say)
        stop.done = True
    return _finish(run_dir, ckpt, report, loop, step, main_process)


def _close(loop, report: Reporter, ckpt: Checkpointer, say) -> None:
    """The exit path, each part guarded on its own: the profiler trace, the metrics writer (a full
    disk can fail its flush) and the checkpointer, which waits for the save in flight and, if that
    save failed, removes its partial files and raises its one-line error (which wins)."""
    for what, close in (
        ("the profiler trace", lambda: loop.profiler.stop(loop.state, loop.step)),
        ("the metrics writer", report.close),
    ):
        try:
            close()
        except Exception as e:  # noqa: BLE001 - reported, never allowed to skip the checkpoint's own close
            say(f"note: closing {what} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    ckpt.close()  # waits for any async save in flight (signals wait too): a started save is finished


def _restore_or_init(cfg, built, ckpt: Checkpointer, run_dir: Path, say) -> tuple[dict, int, int, dict]:
    """(state, data position, skipped steps, the checkpoint's metadata or {}): restored from
    `restore_from`, else resumed from the run's own newest good checkpoint, else freshly initialised."""
    restored = None
    if cfg.restore_from:
        restored = restore(cfg.restore_from, built.spec.abstract, log=say)
        ckpt.move_newer_aside(restored.step, log=say)  # their labels would collide with the new ones
    elif cfg.checkpoint.resume and ckpt.all_steps():
        restored = restore(ckpt, built.spec.abstract, log=say)
    elif ckpt.all_steps():  # resume=false on a run_dir with checkpoints: never mix two runs' steps
        if not cfg.checkpoint.supersede:
            raise ConfigError(
                f"config field `checkpoint.resume`: false, but {ckpt.directory} holds checkpoints "
                f"(steps {ckpt.all_steps()}) that a new run would mix with; choose a new run_dir, "
                "or set checkpoint.supersede=true to move them aside as N.superseded"
            )
        ckpt.move_newer_aside(None, log=say)
    if ckpt.unfinished:  # removed by the Checkpointer: say what this start does instead
        n = len(ckpt.unfinished)
        say(
            f"removed the unfinished save{'s' * (n > 1)} of step{'s' * (n > 1)} "
            f"{', '.join(map(str, ckpt.unfinished))} in {ckpt.directory} (a run stopped mid-save); "
            + (
                "no complete checkpoint is left: starting from step 0"
                if restored is None
                else f"starting from step {restored.step} of {restored.directory}"
                if cfg.restore_from
                else f"resuming from step {restored.step}, the newest complete checkpoint"
            )
        )
    if restored is None:
        return built.init_state(), 0, 0, {}
    position = int(restored.meta["data_position"])
    say(f"restored step {restored.step} from {restored.directory} (data position {position})")
    if jax.process_index() == 0:
        note_config_change(run_dir, cfg, restored.step)
    return restored.state, position, int(restored.meta.get("skipped_steps", 0)), restored.meta


def _evaluator(built, eval_data, reading):
    """params -> eval result (runtime/evaluation.py): the loss per target token over train.eval_batches
    global batches of the held-out split (all of a smaller split, once), or with train.eval_tokens
    over batches as CoLA reads them; and CoLA's reported form beside it (`cola_loss`)."""
    return lambda params, stop=None: eval_loss(built, eval_data, params, stop=stop, plan=reading)


def _finish(run_dir: Path, ckpt, report: Reporter, loop: TrainLoop, step: int, main_process: bool) -> dict:
    """The run's summary, printed by process 0."""
    evals, writer = report.evals, report.writer
    summary = {
        "run_dir": str(run_dir),
        "checkpoints": str(ckpt.directory),
        "last_checkpoint_step": loop.last_saved,
        "metrics": writer.path,
        "tensorboard": writer.tb_dir,
        "step": step,
        "evals": evals,
        "stopped_by": loop.stopped,
        "skipped_steps": loop.skipped,
    }
    if main_process:
        if evals:
            print(
                f"eval loss: first {evals[0][1]:.4f} (step {evals[0][0]}) -> last {evals[-1][1]:.4f} "
                f"(step {evals[-1][0]})"
            )
        if loop.skipped:
            print(f"{loop.skipped} step(s) were skipped as not finite (train.nonfinite=skip)")
        if loop.stopped:
            print(f"stopped by {loop.stopped} at step {step}; checkpoint saved")
        print(
            f"run dir:      {run_dir}\ncheckpoints:  {ckpt.directory} (last step {loop.last_saved})\n"
            f"metrics:      {writer.path}\ntensorboard:  tensorboard --logdir {writer.tb_dir}"
        )
    return summary


# ---------------------------------------------------------------- the command line


def _flag_error(e: Exception, argv) -> None:
    """A misspelt --config.KEY or a missing --config file as a one-line error, not a traceback."""
    why = e
    while isinstance(why, (AttributeError, KeyError)) and why.args:  # unwrap to ml_collections' text
        why = why.args[0]
    why = str(why).replace("\n", "; ")
    if isinstance(e, OSError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("[Errno")]
        print(
            f"error: --config: {lines[0] if lines else why}; give a config file or a packaged config's name "
            f"({', '.join(n for n in packaged_configs() if '/' not in n)})",
            file=sys.stderr,
        )
    else:
        print(
            f"error: {' '.join(argv[1:])}: unknown key {why} (the keys are those of boost_jax/config/schema.py)",
            file=sys.stderr,
        )
    sys.exit(1)


def _config_path(argv) -> str | None:
    """The file `--config FILE` / `--config=FILE` names in argv, if any."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _packaged_config(argv) -> list:
    """argv with a `--config NAME` of a packaged config (`cola_60m`, or `configs/cola_60m.py` where
    no such file is: an installed wheel) replaced by its file (boost_jax/config/files.py config_path), and
    moved in front of the `--config.KEY=VALUE` overrides: they apply to the file, in any order given."""
    out, picked = [argv[0]] if argv else [], []
    rest = iter(argv[1:])
    for arg in rest:
        if arg.startswith("--config="):
            picked = ["--config=" + config_path(arg.split("=", 1)[1])]
        elif arg == "--config":
            value = next(rest, None)
            picked = ["--config"] + ([] if value is None else [config_path(value)])
        else:
            out.append(arg)
    return out[:1] + picked + out[1:]


def _define_config(argv, flag_values=None):
    from ml_collections import config_flags

    path = _config_path(argv)
    if path:  # a broken file as one line naming it (ml_collections would raise from inside its parser)
        try:
            load_config_file(path, "--config", run_config=True)
        except FileNotFoundError:
            pass  # reported by _flag_error below, as before
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
    kw = {} if flag_values is None else {"flag_values": flag_values}
    try:  # the config file is loaded and the overrides resolved already here and in parsing
        config_flags.DEFINE_config_file(
            "config", str(DEFAULT_CONFIG), "Run config file (configs/*.py)", lock_config=True, sys_argv=argv, **kw
        )
    except (AttributeError, KeyError, OSError) as e:
        _flag_error(e, argv)


def parse_config(argv):
    """The config `python -m boost_jax.train ARGV...` would run (argv[0] is the program name), parsed
    exactly as the command line does it, on private flags (so it may be called many times)."""
    from absl import flags

    fv = flags.FlagValues()
    argv = _packaged_config(argv)
    _define_config(argv, fv)
    try:
        fv(argv)
        cfg = fv.config
        cfg.name  # noqa: B018 - a config file that failed to load raises on first use
    except (AttributeError, KeyError, OSError) as e:
        _flag_error(e, argv)
    except flags.Error as e:
        _flags_error(e)
    return cfg


USAGE = """Pre-train a model: python -m boost_jax.train [--config FILE|NAME] [--config.KEY=VALUE ...]
(also: boost-train). Without flags it trains the tiny CoLA model on the embedded corpus.

  --config FILE|NAME   a config file (configs/cola_60m.py) or a packaged config's name (cola_60m);
                       default: tiny
  --config.KEY=VALUE   override one key (below; a misspelt key is an error)
  --print_config       print the resolved config (file + overrides) and exit
  --help               this text

Config keys, their defaults (boost_jax/config/schema.py; a config file changes some) and meaning:"""


def _help(argv) -> bool:
    """--help / --print_config: print and return True (the command exits 0)."""
    if any(a in HELP_FLAGS for a in argv[1:]):
        _print(USAGE + "\n" + describe_config())
        return True
    if "--print_config" in argv[1:]:
        cfg = parse_config([a for a in argv if a != "--print_config"])
        _print(str(cfg) + "\n" + _autos_here(cfg))
        return True
    return False


def _autos_here(cfg) -> str:
    """What the config's `auto` fields resolve to on the devices JAX sees here (model/autos.py)."""
    try:
        devices = mesh_devices(cfg.parallel)
        picks = autos.chosen(cfg, len(devices), devices)
    except ConfigError as e:
        return f"# auto: not resolved on this machine's devices ({e})"
    where = f"{len(devices)} x {devices[0].device_kind}"
    return f"# auto, on {where}: " + (autos.describe(picks) or "nothing left to resolve")


HELP_FLAGS = ("--help", "-h", "--helpfull", "--helpshort", "--helpxml", "-?")  # absl's too: all print ours


def _print(text: str) -> None:
    """Print to stdout; a reader that closed the pipe early (`| head`) ends it quietly, not with a
    BrokenPipeError traceback."""
    import os

    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere


def _flags_error(e: Exception) -> None:
    """A command line absl cannot parse (a flag that is not ours, a flag without its value) as one line
    pointing at our --help, not at absl's."""
    print(
        f"error: {str(e).splitlines()[0]}; python -m boost_jax.train --help lists the flags and every config key",
        file=sys.stderr,
    )
    sys.exit(1)


def main(argv=None) -> int:
    from absl import app, flags

    xla_gpu_flags.quiet_gpu_plugin()  # before JAX starts its backends (--print_config starts them)
    argv = _packaged_config(sys.argv if argv is None else argv)
    if _help(argv):
        return 0
    _define_config(argv)

    def parse(args):
        try:
            return flags.FLAGS(args)
        except (AttributeError, KeyError, OSError) as e:
            _flag_error(e, args)
        except flags.Error as e:  # (absl's own parse_flags_with_usage would suggest absl's --helpshort)
            _flags_error(e)

    stop = StopFlag()

    def _main(_):
        try:
            cfg = flags.FLAGS.config
            cfg.name  # noqa: B018 - a config file that failed to load raises on first use
        except OSError as e:
            _flag_error(e, argv)
        try:
            run(
                cfg, stop.__enter__(), _config_path(argv) or str(DEFAULT_CONFIG)
            )  # stop: never uninstalled: a signal after the final save is absorbed too
        except ERRORS as e:
            print(error_lines(e), file=sys.stderr)
            sys.exit(1)
        finally:  # the interpreter's shutdown can drop the handlers: a late signal would end it with 143
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    app.run(_main, argv=argv, flags_parser=parse)
    return 0


if __name__ == "__main__":
    main()

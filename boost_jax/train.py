"""Pre-train a model: `python -m boost_jax.train [--config configs/X.py] [--config.key=value ...]`.

Without flags it trains the tiny CoLA model on the embedded corpus on whatever devices JAX sees.
"""
from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging as absl_logging
from tqdm import tqdm

from boost_jax import config as config_lib
from boost_jax.checkpoint import Checkpointer, CheckpointError, resolve
from boost_jax.data import build_loaders
from boost_jax.distributed import DistributedError, maybe_initialize
from boost_jax.kernels.rmsnorm import kernels_used
from boost_jax.metrics import MetricsWriter, fmt_mfu, throughput
from boost_jax.model import flops_per_token
from boost_jax.optim import make_optimizer
from boost_jax.parallel.mesh import BATCH_AXES, make_mesh
from boost_jax.parallel.rules import use_rules
from boost_jax.parallel.strategies import get_strategy
from boost_jax.state import init_state, state_spec
from boost_jax.step import jit_train_step, make_eval_step
from jax.sharding import NamedSharding, PartitionSpec as P

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.py"


def _agree(signal_name):
    """The signal any process received, or None; a collective, so all processes call it together."""
    from jax.experimental import multihost_utils
    got = multihost_utils.process_allgather(np.int32(signal_name is not None))
    return (signal_name or "SIGTERM") if np.any(got) else None


class TrainingDiverged(RuntimeError):
    pass


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves, waits for the save, and exits cleanly."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test runner thread)
                pass
        return self

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _batch_slice(mesh, global_batch: int) -> tuple[int, int]:
    """(index, count) of the slice of the global batch this process feeds. Processes whose devices
    hold the same rows (a tensor or pipeline axis spanning processes) must load the same rows."""
    shards = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map((global_batch,))
    lo = min(idx[0].start or 0 for idx in shards.values())
    hi = max(global_batch if idx[0].stop is None else idx[0].stop for idx in shards.values())
    return lo // (hi - lo), global_batch // (hi - lo)


def _to_global(batch: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, batch)


def run(cfg) -> dict:
    """Train per `cfg`; returns a summary (first/last eval loss, where things were written)."""
    config_lib.validate(cfg)
    maybe_initialize(cfg)  # before anything below asks JAX for devices (process_index does)
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save step at INFO
    t, main_process = cfg.train, jax.process_index() == 0
    run_dir = Path(cfg.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(cfg)
    strategy = get_strategy(cfg.parallel)
    train_data, eval_data, _ = build_loaders(cfg, *_batch_slice(mesh, t.global_batch))
    tx, schedule = make_optimizer(t)
    fpt = flops_per_token(cfg.model, t.seq_len)
    tokens_per_step = t.global_batch * t.seq_len
    device_kind = jax.devices()[0].device_kind

    with use_rules(mesh, strategy):
        spec = state_spec(cfg, tx, mesh, strategy)
        ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        state, position = None, 0
        source = None
        if cfg.restore_from:
            root, step = resolve(cfg.restore_from)
            source = Checkpointer(root, keep=cfg.checkpoint.keep, create=False)
            step = source.latest_step() if step is None else step
            if step is None:
                raise CheckpointError(f"config field `restore_from`: no checkpoint in {root}")
        elif cfg.checkpoint.resume and ckpt.latest_step() is not None:
            source, step = ckpt, ckpt.latest_step()
        if source is not None:
            state, meta = source.restore(step, spec.abstract)
            position = int(meta["data_position"])
            if main_process:
                print(f"restored step {step} from {source.directory} (data position {position})")
        else:
            state = init_state(cfg, tx, spec)

        train_step, batch_sharding = jit_train_step(spec, tx, schedule, mesh)
        eval_sharding = NamedSharding(mesh, P(BATCH_AXES))
        eval_step = jax.jit(make_eval_step(spec.graphdef, t.eval_microbatches or t.grad_accum),
                            in_shardings=(spec.shardings["params"], eval_sharding))

        def evaluate(params) -> float:
            losses = [eval_step(params, _to_global(eval_data.batch(i * t.global_batch), eval_sharding))
                      for i in range(t.eval_batches)]
            return float(np.mean(jax.device_get(losses)))

        def meta(step: int) -> dict:
            return {"data_position": position, "step": step, "config": json.loads(cfg.to_json_best_effort())}

        writer = MetricsWriter(str(run_dir), enabled=main_process)
        if main_process:
            (run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
        step = int(jax.device_get(state["step"]))
        evals: list[tuple[int, float]] = []
        if step < t.steps:
            evals.append((step, evaluate(state["params"])))
            writer.write(step, {"eval_loss": evals[-1][1]})
        bar = tqdm(total=t.steps, initial=step, disable=not (main_process and t.progress), dynamic_ncols=True,
                   desc=cfg.name, unit="step")
        window_start, window_steps, last_saved, stopped = time.perf_counter(), 0, step, None
        first_step = step
        kernels_used()  # start the record afresh: the first train step below traces the model
        end = min(t.stop_at_step or t.steps, t.steps)
        try:
            with _StopFlag() as stop:
                while step < end:
                    local = train_data.batch(position).reshape(t.grad_accum, -1, t.seq_len + 1)
                    state, metrics = train_step(state, _to_global(local, batch_sharding))
                    if step == first_step:  # traced now: record what the kernels actually ran
                        writer.write(step + 1, {"kernels": kernels_used()})
                    position += t.global_batch
                    step += 1
                    window_steps += 1
                    bar.update(1)
                    signalled = stop.signal  # read once: a signal arriving later is handled next step
                    due_log = step % t.log_every == 0 or step == end
                    if jax.process_count() > 1:  # every process must stop (and save) at the same step
                        signalled = _agree(signalled) if due_log else None
                    due_save = step % cfg.checkpoint.every == 0 or step == end or signalled
                    if due_log or due_save:
                        m = jax.device_get(metrics)
                        if not m["finite"]:
                            raise TrainingDiverged(
                                f"loss became {m['loss']} (grad norm {m['grad_norm']}) at step {step}; "
                                f"stopping. The last good checkpoint is step {ckpt.latest_step()} in "
                                f"{ckpt.directory}; lower train.lr or raise train.warmup_steps")
                    if due_log:
                        elapsed = time.perf_counter() - window_start
                        rate = throughput(tokens_per_step * window_steps, elapsed, fpt, jax.device_count(), device_kind)
                        record = {"loss": float(m["loss"]), "perplexity": math.exp(min(float(m["loss"]), 50.0)),
                                  "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                                  "step_time_s": elapsed / window_steps, **rate}
                        writer.write(step, record)
                        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate['tokens_per_s']:.0f}",
                                        mfu=fmt_mfu(rate["mfu"]))
                        window_start, window_steps = time.perf_counter(), 0
                    if t.eval_every and (step % t.eval_every == 0 or step == end):
                        evals.append((step, evaluate(state["params"])))
                        writer.write(step, {"eval_loss": evals[-1][1]})
                        bar.write(f"step {step}: eval loss {evals[-1][1]:.4f}") if main_process else None
                    if due_save:
                        ckpt.save(step, state, meta(step), force=True)
                        last_saved = step
                    if signalled:
                        stopped = signalled
                        break
        finally:
            bar.close()
            ckpt.close()  # waits for any async save in flight: a started save is always finished
            writer.close()
    summary = {"run_dir": str(run_dir), "checkpoints": str(ckpt.directory), "last_checkpoint_step": last_saved,
               "metrics": writer.path, "tensorboard": writer.tb_dir, "step": step, "evals": evals,
               "stopped_by": stopped}
    if main_process:
        if evals:
            print(f"eval loss: first {evals[0][1]:.4f} (step {evals[0][0]}) -> last {evals[-1][1]:.4f} "
                  f"(step {evals[-1][0]})")
        if stopped:
            print(f"stopped by {stopped} at step {step}; checkpoint saved")
        print(f"run dir:      {run_dir}\ncheckpoints:  {ckpt.directory} (last step {last_saved})\n"
              f"metrics:      {writer.path}\ntensorboard:  tensorboard --logdir {writer.tb_dir}")
    return summary


def main(argv=None) -> int:
    from absl import app, flags
    from ml_collections import config_flags

    flags_ = flags.FLAGS
    config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Run config file (configs/*.py)",
                                    lock_config=True)

    def _main(_):
        try:
            run(flags_.config)
        except (config_lib.ConfigError, CheckpointError, TrainingDiverged, DistributedError, FileNotFoundError,
                ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)

    app.run(_main, argv=argv)
    return 0


if __name__ == "__main__":
    main()

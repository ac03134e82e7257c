"""Orbax checkpoints: async saves, keep-last-K, resume, restore into the running mesh's shardings.

A checkpoint step holds two items: `state` (params, optimizer state, step, rng; restored into
abstract target shardings, so any mesh can read any checkpoint) and `meta` (JSON: data position,
the config, the parameter shapes). Before restoring, the saved shapes are compared with the model
being built, so an incompatible checkpoint fails with the names of the mismatched parameters and
nothing on disk is touched.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    pass


def _flat_shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}


def resolve(path: str) -> tuple[Path, int | None]:
    """A run dir, its `checkpoints/` dir, or one step dir -> (manager root, step or None for latest)."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise CheckpointError(f"config field `restore_from`: {str(p)!r} does not exist")
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    if p.name.isdigit() and (p / "state").is_dir():
        return p.parent, int(p.name)
    return p, None


def config_from_meta(meta: dict):
    """The run config a checkpoint was saved with, on top of today's defaults (new keys keep them)."""
    from boost_jax.config import base_config
    cfg = base_config()
    cfg.unlock()
    for section, values in meta["config"].items():
        if isinstance(values, dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    return cfg


def read_run(checkpoint: str):
    """(config the run was saved with, checkpoint root, step) for a run dir, checkpoints dir or step dir."""
    root, step = resolve(checkpoint)
    ckpt = Checkpointer(root, keep=1, create=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint found in {root}")
    cfg = config_from_meta(ckpt.read_meta(step))
    ckpt.close()
    return cfg, root, step


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, *, keep: int, async_save: bool = True, create=True):
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=create)
        self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "meta"), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        meta = {**meta, "param_shapes": {k: list(v) for k, v in _flat_shapes(state["params"]).items()}}
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)

    def read_meta(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
            raise CheckpointError(f"checkpoint {self.directory}/{step} is unreadable ({type(e).__name__}: {e}); "
                                  "it was left untouched; restore another step with "
                                  "--config.restore_from=DIR/STEP") from e

    def check_compatible(self, step: int, abstract_state) -> dict:
        meta = self.read_meta(step)
        saved = {k: tuple(v) for k, v in meta.get("param_shapes", {}).items()}
        want = _flat_shapes(abstract_state["params"])
        missing = sorted(set(want) - set(saved))
        extra = sorted(set(saved) - set(want))
        wrong = sorted(k for k in set(want) & set(saved) if want[k] != saved[k])
        if missing or extra or wrong:
            lines = [f"  {k}: checkpoint {saved[k]} vs model {want[k]}" for k in wrong[:8]]
            lines += [f"  {k}: not in checkpoint" for k in missing[:4]]
            lines += [f"  {k}: not in model" for k in extra[:4]]
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} does not fit this model "
                f"({len(wrong)} shape mismatches, {len(missing)} missing, {len(extra)} unexpected):\n"
                + "\n".join(lines)
                + "\nThe checkpoint was left untouched. Use the config it was saved with, or a new run_dir.")
        return meta

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """(state in the abstract tree's shardings, meta). Raises CheckpointError, never deletes."""
        meta = self.check_compatible(step, abstract_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {self.directory}/{step} could not be restored "
                                  f"({type(e).__name__}: {e}); it was left untouched") from e
        return restored["state"], meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

"""Orbax checkpoints: async saves, keep-last-K, resume, and the one way to restore (`restore`).

A checkpoint step holds two items: `state` (params, optimizer state, step, rng; restored into
abstract target shardings, so any mesh can read any checkpoint) and `meta` (JSON: data position,
the config, the parameter shapes, a checksum per array). Before restoring, the saved shapes are
compared with the model being built: an incompatible checkpoint fails naming the mismatched
parameters, and nothing on disk is touched. `restore(source, abstract_state, ...)` is what train,
evaluate, generate and export call: the whole state or the parameters only, the newest good step or
a given one, onto whatever mesh the abstract tree's shardings describe, checksums verified.

Integrity: a state is saved only if every parameter and optimizer array is finite; every array's
checksum (computed on device, independent of the sharding) is verified after a restore. A step that
fails to read or to verify is `CorruptCheckpoint`: `restore_newest_good` falls back to the newest
good step and renames the bad ones aside (`N.corrupt`), never deleting them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from boost_jax.config import base_config
from boost_jax.errors import CheckpointError, CorruptCheckpoint
from boost_jax.runtime.checkpoints.failures import (
    one_line,
    os_reason,
    quiet_closed_loop,
    quiet_orbax_errors,
    store_reason,
)

RESTORE_HINT = "--config.restore_from=DIR/STEP"  # how the trainer picks a step; the tools pass theirs


def _flat_shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}


def _checksum(x):
    """sum_i bits_i * (2 i + 1) mod 2^32 over the array's elements: any single flipped bit changes it
    (the weight is odd), and integer sums do not depend on how the array is sharded or reduced."""
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    words = (x if x.dtype == bits else jax.lax.bitcast_convert_type(x, bits)).astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for d in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * np.uint32(stride % 2**32)
        stride *= x.shape[d]
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


def _finite(x):
    return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)


@jax.jit
def _fingerprint(tree):
    return jax.tree.map(_checksum, tree), jax.tree.map(_finite, tree)


def fingerprint(tree) -> tuple[dict[str, int], list[str]]:
    """({array path: checksum}, [paths of arrays with a NaN or inf]) of a pytree of arrays."""
    sums, finite = jax.device_get(_fingerprint(tree))
    sums = {jax.tree_util.keystr(p): int(v) for p, v in jax.tree_util.tree_flatten_with_path(sums)[0]}
    bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(finite)[0] if not v]
    return sums, bad


def _names(paths: list[str], n: int = 4) -> str:
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more" if len(paths) > n else "")


def verify(tree, meta: dict, where: str, hint: str = RESTORE_HINT) -> None:
    """Raise CorruptCheckpoint if restored arrays differ from the checksums saved with them or are not
    finite. Checkpoints written before checksums were recorded are only checked for finiteness."""
    sums, bad = fingerprint(tree)
    saved = meta.get("checksums", {})
    wrong = sorted(k for k, v in sums.items() if k in saved and saved[k] != v)
    if wrong:
        raise CorruptCheckpoint(
            f"{where}: {len(wrong)} array(s) do not match the checksums saved with them "
            f"({_names(wrong)}): the files were damaged after saving; it was left untouched; "
            f"use another step with {hint}"
        )
    if bad:
        raise CorruptCheckpoint(
            f"{where} holds NaN/inf values in {_names(bad)}; it was left untouched; use another step with {hint}"
        )


def resolve(path: str, field: str = "config field `restore_from`") -> tuple[Path, int | None]:
    """A run dir, its `checkpoints/` dir, or one step dir -> (manager root, step or None for latest)."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise CheckpointError(f"{field}: {str(p)!r} does not exist")
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    if p.name.isdigit() and (p / "state").is_dir():
        return p.parent, int(p.name)
    return p, None


def config_from_meta(meta: dict):
    """The run config a checkpoint was saved with, on top of today's defaults (new keys keep them)."""
    cfg = base_config()
    cfg.unlock()
    for section, values in meta["config"].items():
        if isinstance(values, dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    return cfg


def read_run(checkpoint: str):
    """(config the run was saved with, checkpoint root, step) for a run dir, checkpoints dir or step dir;
    errors speak of the tools' `--checkpoint` flag."""
    root, step = resolve(checkpoint, "--checkpoint")
    ckpt = Checkpointer(root, keep=1, create=False, hint="--checkpoint DIR/STEP")
    step = ckpt.latest_step() if step is None else step
    if step is None:
        ckpt.close()
        if any(Path(root).glob("*.safetensors")):  # an export (boost_jax/export.py), or any HF model
            raise CheckpointError(
                f"--checkpoint: {root} holds a Hugging Face model (safetensors), not a run's checkpoints; "
                f"import it first: python -m boost_jax.export --import-hf {root} --out runs/NAME, then "
                "--checkpoint runs/NAME"
            )
        raise CheckpointError(f"--checkpoint: no checkpoint found in {root}")
    cfg = config_from_meta(ckpt.read_meta(step))
    ckpt.close()
    return cfg, root, step


def read_newest(checkpoint: str, read, tries: int = 5, log=None):
    """read(cfg, root, step) for the step `checkpoint` names, or for a run dir (or its checkpoints
    dir) its newest intact step, as training resumes: a damaged newer step (unreadable, not matching
    its checksums, not finite) is skipped, and `log` (default: stderr) gets one line naming it and
    the step read instead; nothing is renamed (the run dir is its trainer's). A trainer running there
    with keep-K rotation may remove a step while it is being read: then (the step gone from disk, not
    damaged) the newest step is read instead, up to `tries` times. A named step is read or refused."""
    root, named = resolve(checkpoint, "--checkpoint")
    if named is not None:
        cfg, root, step = read_run(checkpoint)
        return read(cfg, root, step)
    log = log or (lambda text: print(text, file=sys.stderr))
    damaged: dict[int, CorruptCheckpoint] = {}
    rotated = 0
    while True:
        step = None
        if damaged:  # the newest step not known to be damaged
            step = max((s for s in _listed(root) if s not in damaged), default=None)
            if step is None:
                raise _all_damaged(root, damaged)
        try:
            if step is None:
                cfg, root, step = read_run(checkpoint)
            else:
                cfg = config_from_meta(_read_meta(root, step))
            result = read(cfg, root, step)
        except CorruptCheckpoint as e:
            if step is None:  # read_run could not read the newest step's record
                step = max(_listed(root), default=None)
            if step is None or not (Path(root) / str(step)).exists():  # rotated away under us
                rotated += 1
                if rotated >= tries:
                    raise
                continue
            damaged[step] = e
            continue
        if damaged:
            log(
                f"warning: {'; '.join(_what(damaged[s]) for s in sorted(damaged, reverse=True))}; using step "
                f"{step}, the newest intact checkpoint in {root}"
            )
        return result


def _listed(root) -> list[int]:
    """The steps on disk under a checkpoint root (as Orbax lists them)."""
    ckpt = Checkpointer(root, keep=1, create=False, hint="--checkpoint DIR/STEP")
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


def _read_meta(root, step: int) -> dict:
    ckpt = Checkpointer(root, keep=1, create=False, hint="--checkpoint DIR/STEP")
    try:
        return ckpt.read_meta(step)
    finally:
        ckpt.close()


def _what(e: CorruptCheckpoint) -> str:
    """A damaged step's error without its advice (what the fallback line quotes)."""
    return str(e).split("; it was left untouched")[0]


def _all_damaged(root, damaged: dict) -> CheckpointError:
    if len(damaged) == 1:
        return next(iter(damaged.values()))
    newest = max(damaged)
    return CorruptCheckpoint(
        f"every checkpoint in {root} is damaged (steps {sorted(damaged)}; the newest: "
        f"{_what(damaged[newest])}); they were left untouched; give another run, or one step of "
        "it, with --checkpoint DIR/STEP"
    )


def _damage(step_dir: Path, e: Exception, parts) -> str:
    """What a failed read of `step_dir` tells: the first of `parts` (paths in it) that is missing,
    else Orbax's error in one line."""
    missing = [part for part in parts if not (step_dir / part).exists()]
    if missing:
        return f"its {missing[0]} is missing"
    return store_reason(e, step_dir) or f"{type(e).__name__}: {one_line(e)}"


def _state_parts(step_dir: Path, whole: bool) -> list[str]:
    """What reading a step's state needs besides the arrays: its directory, the tree's structure record
    `_METADATA` (a whole-state restore reads it) and, in Orbax's OCDBT layout, the array database's root."""
    state = step_dir / "state"
    parts = ["state"] + (["state/_METADATA"] if whole else [])
    if (state / "d").is_dir() or any(state.glob("ocdbt.process_*")):
        parts.append("state/manifest.ocdbt")
    return parts


def move_aside(step_dir: Path, why: str) -> Path:
    """Rename a step directory to `N.<why>` (never delete it); returns the new path."""
    target, n = step_dir.with_name(f"{step_dir.name}.{why}"), 1
    while target.exists():
        target, n = step_dir.with_name(f"{step_dir.name}.{why}.{n}"), n + 1
    step_dir.rename(target)
    return target


@dataclasses.dataclass
class Restored:
    state: dict  # the restored tree (just {"params": ...} for a params-only restore)
    meta: dict  # data position, config, shapes, checksums
    step: int
    directory: Path  # the checkpoint root it came from


def restore(
    source,
    abstract_state,
    *,
    step: int | None = None,
    hint: str = RESTORE_HINT,
    log=print,
    field: str = "config field `restore_from`",
) -> Restored:
    """The one way to restore. `source`: a run dir, its `checkpoints/` dir, one step dir, or an open
    Checkpointer (the run's own: it may rename damaged steps aside). `abstract_state`: ShapeDtypeStructs
    carrying the TARGET shardings (any mesh, any strategy), the whole train state or {"params": ...}
    for the parameters only. `step`: that step; None: the one a step dir names, else the newest step
    that restores intact (damaged newer ones are reported and skipped). Checksums are verified;
    nothing on disk is ever deleted. Errors are CheckpointError with one line naming `field`/`hint`."""
    own = isinstance(source, Checkpointer)
    if own:
        ckpt = source
    else:
        root, named = resolve(source, field)
        step = named if step is None else step
        ckpt = Checkpointer(root, keep=1, create=False, hint=hint)
    try:
        if step is not None:
            state, meta = ckpt.restore(step, abstract_state)
        else:
            if not ckpt.all_steps():
                raise CheckpointError(f"{field}: no checkpoint in {ckpt.directory}")
            state, meta, step = ckpt.restore_newest_good(abstract_state, log=log)
    finally:
        if not own:
            ckpt.close()
    return Restored(state, meta, step, ckpt.directory)


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int,
        async_save: bool = True,
        create=True,
        owner: bool = False,
        hint: str = RESTORE_HINT,
    ):
        """owner: this process holds the run directory's lock, so it may remove leftovers of unfinished
        saves (`*.orbax-checkpoint-tmp*`) and rename bad steps aside."""
        self.directory = Path(directory).resolve()
        self.hint, self.pending = hint, None
        self.failure = None  # the failed save already reported (its error is raised once)
        quiet_closed_loop()  # a damaged step's failed read: one line, not Orbax's loop's leftovers
        self._renames = owner and jax.process_index() == 0  # one process renames and removes
        # Saves a stopped run left unfinished (a SIGKILL mid-save), removed now: the steps they would
        # have been are named, so the start can say what it resumes from instead.
        self.unfinished = sorted(
            (int(p.name.split(".")[0]) for p in self._tmp_dirs() if p.name.split(".")[0].isdigit()), reverse=True
        )
        self._remove_partial()
        if owner:
            quiet_orbax_errors()  # a failed save is reported once, as one line (`_failed`)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=create, cleanup_tmp_directories=owner
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "meta"), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        """Start saving `state` as `step` (in the background when async). Refuses (CheckpointError, nothing
        written) a state with a non-finite parameter or optimizer array."""
        sums, bad = fingerprint(state)
        if bad:
            raise CheckpointError(f"not saving step {step}: NaN/inf in {_names(bad)}")
        meta = {
            **meta,
            "param_shapes": {k: list(v) for k, v in _flat_shapes(state["params"]).items()},
            "checksums": sums,
        }
        self.wait()  # Orbax would wait for the previous save too; this way its failure is reported as such
        self.pending = step
        try:
            return self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as e:  # noqa: BLE001 - e.g. the disk filled up during the synchronous part
            self._failed(e)

    def committed_step(self) -> int | None:
        """The newest step whose save has finished (its directory renamed into place)."""
        steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()] if self.directory.is_dir() else []
        return max(steps, default=None)

    def read_meta(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
            raise CorruptCheckpoint(
                f"checkpoint {self.directory}/{step} is unreadable "
                f"({_damage(self.directory / str(step), e, ['meta'])}); "
                f"it was left untouched; restore another step with {self.hint}"
            ) from e

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
                + "\nThe checkpoint was left untouched. Use the config it was saved with, or a new run_dir."
            )
        return meta

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """(state in the abstract tree's shardings, meta), verified against the saved checksums. An
        abstract tree holding only "params" reads just those arrays (the optimizer moments stay on disk).
        Raises CheckpointError (CorruptCheckpoint for damaged data), never deletes."""
        meta = self.check_compatible(step, abstract_state)
        try:
            if set(abstract_state) == {"params"}:
                state = self._read_partial(step, abstract_state)
            else:
                state = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
                )["state"]
        except Exception as e:  # noqa: BLE001
            where = self.directory / str(step)
            parts = _state_parts(where, whole=set(abstract_state) != {"params"})
            raise CorruptCheckpoint(
                f"checkpoint {self.directory}/{step} could not be restored "
                f"({_damage(where, e, parts)}); it was left untouched; "
                f"restore another step with {self.hint}"
            ) from e
        verify(state, meta, f"checkpoint {self.directory}/{step}", self.hint)
        return state, meta

    def _read_partial(self, step: int, target: dict) -> dict:
        """Only the arrays of `target` (a subtree of the saved state), in its shardings."""
        restore_args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
        )
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(
                self.directory / str(step) / "state",
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
            )

    def restore_newest_good(self, abstract_state, log=print):
        """(state, meta, step) of the newest step that restores intact. Damaged newer steps are skipped
        with a message and, when this process group owns the directory, renamed aside to `N.corrupt`
        (by process 0). Raises CheckpointError if no step is good (then nothing is renamed) or if a
        step does not fit the model."""
        damaged = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
            except CorruptCheckpoint as e:
                damaged.append(step)
                log(f"warning: {str(e).split('; it was left untouched')[0]}")
                continue
            for bad in damaged if self._renames else ():
                log(
                    f"moved damaged checkpoint {self.directory / str(bad)} aside to "
                    f"{move_aside(self.directory / str(bad), 'corrupt')}"
                )
            if damaged:
                self._reload()
                log(f"falling back to step {step}, the newest intact checkpoint")
            return state, meta, step
        if damaged:
            raise CheckpointError(
                f"every checkpoint in {self.directory} is damaged (steps {damaged}); they were "
                f"left untouched. Start a new run_dir, or restore another run with {self.hint}"
            )
        raise CheckpointError(f"no checkpoint in {self.directory}")

    def move_newer_aside(self, step: int | None, log=print, *, suffix: str = "superseded", why: str = "") -> None:
        """Rename steps newer than `step` (None: every step) to `N.<suffix>` (never deleted), so that
        training from `step` (or from scratch) can save again without mixing with them."""
        newer = [s for s in self.all_steps() if step is None or s > step]
        why = why or ("a new run (checkpoint.supersede)" if step is None else f"newer than the restored step {step}")
        for s in newer if self._renames else ():
            log(
                f"moved checkpoint {self.directory / str(s)} ({why}) aside to "
                f"{move_aside(self.directory / str(s), suffix)}"
            )
        if newer:
            self._reload()

    def _reload(self) -> None:
        """Re-list the steps after process 0 renamed some (every process must see the same list)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("boost_jax checkpoints renamed")
        self.manager.reload()

    def check(self) -> None:
        """Raise CheckpointError if a background save failed; its partial files are removed first, so
        the previous checkpoints stay the newest on disk."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def _failed(self, e: Exception):
        step, self.pending = self.pending, None
        try:  # the save's other writer threads may still be creating files: let them end first
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001 - the same failure, reported below
            pass
        removed = self._remove_partial()
        latest = self.committed_step()
        last = f"step {latest} in {self.directory}" if latest is not None else f"none (nothing in {self.directory})"
        # the operating system's reason first, whichever writer hit it (tensorstore's message or a
        # plain OSError from a metadata file): the line reads the same either way
        reason = (
            os_reason(e)
            if not isinstance(e, OSError)
            else (f"{e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]" if e.strerror else None)
        )
        self.failure = CheckpointError(
            f"saving step {step} failed{f': {reason}' if reason else ''} "
            f"({type(e).__name__}: {one_line(e)}); "
            f"{'its partial files were removed; ' if removed else ''}"
            f"the last good checkpoint is {last}. Fix the cause (disk space, "
            "permissions) and rerun to resume from it"
        )
        raise self.failure from e

    def _tmp_dirs(self) -> list[Path]:
        """The directories of unfinished saves (`N.orbax-checkpoint-tmp*`), if ours to remove."""
        return list(self.directory.glob("*.orbax-checkpoint-tmp*")) if self._renames else []

    def _remove_partial(self) -> list[str]:
        """Remove the files of unfinished saves (none is in flight: the caller waited), if ours to."""
        removed = []
        for tmp in self._tmp_dirs():
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp.name)
        return removed

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            if self.failure is None:
                self._failed(e)
            self._remove_partial()  # Orbax raises a reported failure again: its late files go too
        self.pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - Orbax re-raising the failed save that was reported
                if self.failure is None:
                    raise
            finally:
                if self.failure is not None:
                    self._settle()

    def _settle(self, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
        """After a failed save: tensorstore's writer threads may still be finishing its other writes
        (each failing like the first) and recreate its `*.orbax-checkpoint-tmp` directories after they
        were removed. Remove them until none has reappeared for `quiet_s` (at most `limit_s`), and once
        more at exit; the coroutines of the abandoned writes are never awaited, which is expected."""
        import atexit
        import time
        import warnings

        warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
        start = quiet = time.monotonic()
        while time.monotonic() - quiet < quiet_s and time.monotonic() - start < limit_s:
            if self._remove_partial():
                quiet = time.monotonic()
            time.sleep(0.05)
        atexit.register(self._remove_partial)

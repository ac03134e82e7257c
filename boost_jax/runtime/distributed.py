"""Multi-process start-up: `maybe_initialize(cfg)` joins the JAX distributed system when the run
spans several processes (hosts, or one process per GPU), and does nothing for a single process.

Where the settings come from, first match wins:
  1. `distributed.coordinator_address / num_processes / process_id` in the config;
  2. the environment: BOOST_COORDINATOR (host:port of process 0), BOOST_NUM_PROCESSES,
     BOOST_PROCESS_ID (what launch/local_multiprocess.sh sets);
  3. under SLURM with more than one task (SLURM_JOB_ID set, SLURM_NTASKS > 1): JAX detects all three;
  4. otherwise: a single process, nothing to do.
It must run before anything asks JAX for devices (jax.devices, jax.process_index, any computation).
"""

from __future__ import annotations

import os

import jax

from boost_jax.errors import DistributedError

CPU_COLLECTIVES = ("gloo", "mpi")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from None


def settings(cfg) -> dict | None:
    """The initialize() arguments this config and environment ask for (None = let JAX detect it),
    or None for a single-process run."""
    d = cfg.distributed
    coordinator = d.coordinator_address or os.environ.get("BOOST_COORDINATOR", "").strip() or None
    num = d.num_processes if d.num_processes > 0 else _env_int("BOOST_NUM_PROCESSES")
    pid = d.process_id if d.process_id >= 0 else _env_int("BOOST_PROCESS_ID")
    slurm = bool(os.environ.get("SLURM_JOB_ID")) and (_env_int("SLURM_NTASKS") or 1) > 1
    if num == 1 and coordinator is None:
        return None  # asked for one process explicitly
    if coordinator is None and num is None and pid is None:
        return {} if slurm else None  # {}: JAX reads everything from SLURM
    if not slurm:  # outside SLURM nothing can fill in a missing value
        missing = [
            f"{field} (or ${env})"
            for field, env, v in (
                ("distributed.coordinator_address", "BOOST_COORDINATOR", coordinator),
                ("distributed.num_processes", "BOOST_NUM_PROCESSES", num),
                ("distributed.process_id", "BOOST_PROCESS_ID", pid),
            )
            if v is None
        ]
        if missing:
            raise DistributedError(
                "a multi-process run needs all of coordinator address, process count and process id; "
                f"missing: {', '.join(missing)}. Set them, or unset the others for a single process"
            )
    if num is not None and pid is not None and not 0 <= pid < num:
        raise DistributedError(f"config field `distributed.process_id`: {pid} is outside [0, num_processes={num})")
    return {"coordinator_address": coordinator, "num_processes": num, "process_id": pid}


def maybe_initialize(cfg) -> bool:
    """Join the distributed system if the run is multi-process; True if this process is (now) part
    of one. Idempotent, so train.run can be called repeatedly in one process."""
    if jax.distributed.is_initialized():
        return True
    args = settings(cfg)
    if args is None:
        return False
    impl = cfg.distributed.cpu_collectives
    if impl:
        if impl not in CPU_COLLECTIVES:
            raise DistributedError(
                f"config field `distributed.cpu_collectives`: {impl!r} is not one of "
                f"{CPU_COLLECTIVES} (or '' to keep JAX's default)"
            )
        # Only the CPU backend reads it (cross-process collectives between CPU devices); harmless on GPU.
        jax.config.update("jax_cpu_collectives_implementation", impl)
    try:
        jax.distributed.initialize(**args)
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise DistributedError(
                "jax.distributed.initialize() came after something asked JAX for devices; call "
                "boost_jax.runtime.distributed.maybe_initialize(cfg) first thing (before jax.devices(), "
                "jax.process_index() or any computation)"
            ) from e
        raise
    except ValueError as e:
        if args and None not in args.values():
            raise
        # Only SLURM leaves values to JAX (settings() checks the rest), and JAX found no cluster to read.
        raise DistributedError(
            f"SLURM_NTASKS={os.environ.get('SLURM_NTASKS')} asks for a multi-process run but JAX could not "
            f"detect the cluster ({e}); start each process with srun, or set BOOST_COORDINATOR, "
            "BOOST_NUM_PROCESSES and BOOST_PROCESS_ID (distributed.* in the config)"
        ) from e
    return True

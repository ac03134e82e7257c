"""Helpers the command-line tools share: emulated CPU devices and loading a config file.

Nothing here imports jax at module level: `emulate_cpu_devices` must run before jax is imported.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from boost_jax.config import load_config_file

_FLAG = "--xla_force_host_platform_device_count"


def emulate_cpu_devices(n: int) -> None:
    """Ask XLA's CPU backend for at least n devices. Only possible before jax is imported, so a
    no-op afterwards (`pick_devices` then says what went wrong). Harmless on GPU/TPU hosts."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(rf"{_FLAG}=(\d+)", flags)
    if m and int(m.group(1)) >= n:
        return
    flags = re.sub(rf"{_FLAG}=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def pick_devices(n: int, flag: str = "--mesh") -> list:
    """n devices of the default backend, else of the CPU backend (tools only compile, so emulated
    CPU devices serve when the host has fewer accelerators than the mesh needs)."""
    import jax

    devices = jax.devices()
    if len(devices) < n:
        cpu = jax.devices("cpu")
        if len(cpu) < n:
            raise SystemExit(
                f"{flag} needs {n} devices but JAX sees {len(devices)} ({devices[0].platform}) and "
                f"{len(cpu)} CPU devices: jax was imported before XLA_FLAGS could be set; export "
                f"XLA_FLAGS={_FLAG}={n} before starting Python"
            )
        devices = cpu
    return devices[:n]


def load_config(cfg_or_path):
    """A ConfigDict (copied) or the `get_config()` of a configs/*.py file."""
    if not isinstance(cfg_or_path, (str, Path)):
        return cfg_or_path.copy_and_resolve_references()
    try:
        return load_config_file(cfg_or_path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"{e} (expected e.g. configs/cola_7b.py)") from e


# The `parallel.*` axes a --mesh of 3, 4 or 5 sizes names, in order.
MESH_FIELDS = {
    3: ("data", "fsdp", "tensor"),
    4: ("pipeline", "data", "fsdp", "tensor"),
    5: ("pipeline", "data", "fsdp", "context", "tensor"),
}


def parse_mesh(text: str) -> tuple[int, ...]:
    """'data,fsdp,tensor', 'pipeline,data,fsdp,tensor' or 'pipeline,data,fsdp,context,tensor' -> a tuple
    of positive ints."""
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) not in MESH_FIELDS or min(sizes) < 1:
        raise SystemExit(
            f"--mesh: expected positive sizes data,fsdp,tensor or pipeline,data,fsdp,tensor or "
            f"pipeline,data,fsdp,context,tensor (e.g. 1,1,4 or 2,1,1,4 or 1,1,1,2,4), got {text!r}"
        )
    return sizes


def mesh_fields(sizes) -> dict[str, int]:
    """Every `parallel.*` axis size of a parsed --mesh (the axes it leaves out: 1)."""
    return {"pipeline": 1, "context": 1, **dict(zip(MESH_FIELDS[len(sizes)], sizes))}

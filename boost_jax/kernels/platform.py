"""Which devices a program is being built for: the one question the model, the kernels and the
XLA flags ask before choosing an implementation (cuDNN attention, Pallas/Triton kernels, bf16).

    with platform.target(mesh):          # runtime/build.py and the bound steps do this
        platform.name()                  # "gpu" for an H100 mesh, even on a CPU-only host
        platform.device()                # the first device of the mesh (None outside a target)

The answer comes from the devices the step is built on (a mesh's platform), not from
`jax.default_backend()`: a train step compiled for H100s on a host without a GPU (the deviceless
ahead-of-time compile of `boost_jax/tools/aot.py`) picks the GPU paths, and a CPU step built on a
GPU host keeps the CPU ones. Outside any target, the default backend answers, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import jax

_TARGET: contextvars.ContextVar = contextvars.ContextVar("boost_jax_target_device", default=None)
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def first_device(devices):
    if devices is None:
        return None
    if hasattr(devices, "devices"):  # a Mesh
        devices = devices.devices
    if hasattr(devices, "flat"):  # a numpy array of devices
        return next(iter(devices.flat), None)
    if hasattr(devices, "platform"):  # one device
        return devices
    return next(iter(devices), None)


@contextlib.contextmanager
def target(devices):
    """Build for `devices` (a Mesh, an array or list of devices, one device, or None: the default
    backend) inside this block."""
    token = _TARGET.set(first_device(devices))
    try:
        yield
    finally:
        _TARGET.reset(token)


def device():
    """The first target device, or None outside `target`."""
    return _TARGET.get()


def of(dev) -> str:
    """'gpu' | 'cpu' | 'tpu' for one device (CUDA and ROCm devices are 'gpu', as jax names the backend)."""
    p = str(dev.platform).lower()
    return "gpu" if p in _GPU_PLATFORMS else p


def name() -> str:
    """'gpu' | 'cpu' | 'tpu': the target devices' platform, else jax's default backend."""
    dev = _TARGET.get()
    return jax.default_backend() if dev is None else of(dev)


def is_nvidia() -> bool:
    """An NVIDIA GPU is the target (or, outside a target, the default backend)."""
    if name() != "gpu":
        return False
    dev = _TARGET.get() or jax.devices()[0]
    kind = str(getattr(dev, "device_kind", ""))
    if kind.upper().startswith("NVIDIA"):
        return True
    version = str(getattr(getattr(dev, "client", None), "platform_version", "")).lower()
    return "cuda" in version


_CAPABILITY = (
    ("H200", 90),
    ("H100", 90),
    ("H800", 90),
    ("GH200", 90),
    ("A100", 80),
    ("A800", 80),
    ("A10", 86),
    ("L40", 89),
    ("L4", 89),
    ("B200", 100),
    ("GB200", 100),
)


def compute_capability() -> int | None:
    """The target NVIDIA GPU's compute capability as major*10+minor (90 for H100), from the device
    when it says so, else from its name; None when unknown (a real device is then asked by its driver)."""
    dev = _TARGET.get()
    if dev is None or name() != "gpu":
        return None
    cc = getattr(dev, "compute_capability", None)
    if cc:
        m = re.match(r"(\d+)\.(\d+)", str(cc))
        if m:
            return int(m.group(1)) * 10 + int(m.group(2))
    kind = str(getattr(dev, "device_kind", "")).upper()
    for key, value in _CAPABILITY:
        if key in kind:
            return value
    return None


def abstract(shape, dtype):
    """A ShapeDtypeStruct placed on the target device (so a probe compiles for it), or unplaced."""
    dev = _TARGET.get()
    if dev is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(dev))


def probe_once(cache: dict, key, compile_probe, on_failure) -> str:
    """`cache[key]`: "" when `compile_probe()` (a jit lower and compile of small shapes on the target,
    built with `abstract`) succeeds, else why not (`Type: message`); probed once per key, and
    `on_failure(reason)` called the first time (the kernel modules warn there, then run plain jnp)."""
    if key not in cache:
        try:
            compile_probe()
            cache[key] = ""
        except Exception as e:  # noqa: BLE001 - any import/lowering/compile failure means "use XLA"
            cache[key] = f"{type(e).__name__}: {str(e)[:300]}".replace("\n", " ")
            on_failure(cache[key])
    return cache[key]

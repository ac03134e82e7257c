"""Hugging Face files for boost_jax/export.py: safetensors read (bfloat16 too) and written, an
export's directory written whole or not at all, and files in the way moved aside (never deleted)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import numpy as np

from boost_jax.errors import ExportError, install_hint

EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer.model")  # what an export writes


def safetensors_numpy():
    try:
        import safetensors.numpy as st
    except ImportError as e:  # optional dependency
        raise ExportError(f"export/import needs safetensors: {install_hint('hf')}") from e
    return st


def load_safetensors(path) -> dict[str, np.ndarray]:
    """One .safetensors file as numpy; bfloat16 (which safetensors.numpy cannot read) via ml_dtypes.
    A truncated or damaged file is an ExportError naming it."""
    st = safetensors_numpy()
    from safetensors import SafetensorError

    try:
        try:
            return st.load_file(str(path))
        except TypeError:  # "data type 'bfloat16' not understood"
            return _load_via_ml_dtypes(path)
    except (SafetensorError, ValueError, KeyError, TypeError, OSError) as e:
        why = str(e).replace("\n", "; ") or type(e).__name__
        raise ExportError(
            f"{path}: not a readable safetensors file ({why}); it may be truncated "
            "(an interrupted download or copy): fetch or export it again"
        ) from e


def _load_via_ml_dtypes(path) -> dict[str, np.ndarray]:
    """The safetensors layout read by hand: 8-byte header length, JSON header, then the raw tensors."""
    import ml_dtypes

    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
    # np.frombuffer raises ValueError when the file ends before a tensor does.
    return {
        k: np.frombuffer(
            raw, dtypes[v["dtype"]], count=int(np.prod(v["shape"])), offset=8 + n + v["data_offsets"][0]
        ).reshape(v["shape"])
        for k, v in header.items()
    }


def move_aside(path: Path) -> Path:
    """Rename `path` to `NAME.superseded` (`.superseded.N` if taken); never deleted."""
    target, n = path.with_name(path.name + ".superseded"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.superseded.{n}"), n + 1
    path.rename(target)
    return target


def reason(e: OSError) -> str:
    return f"{e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]" if e.strerror else (str(e) or type(e).__name__)


def save_safetensors(st, tensors: dict, path: Path) -> None:
    """safetensors' writer, its I/O errors (a full disk: SafetensorError "... I/O error: No space left on
    device (os error 28)") raised as the OSError they are, so that they are reported like every other write's."""
    from safetensors import SafetensorError

    try:
        st.save_file(tensors, str(path), metadata={"format": "pt"})  # transformers refuses files without it
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number) if code else " ".join(str(e).split()), str(path)) from None


def write_all(out: Path, files: dict) -> None:
    """Write {name: callable(path)} into `out` whole or not at all: each into NAME.tmp, renamed only
    once every one is written, so a failure (a full disk, a read-only mount) leaves `out` as it was.
    Every file gets the mode a new file gets here (0666 less the umask; safetensors writes 0600)."""
    tmps = {name: out / f"{name}.tmp" for name in files}
    umask = os.umask(0)
    os.umask(umask)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, write in files.items():
            write(tmps[name])
            os.chmod(tmps[name], 0o666 & ~umask)
        for name, tmp in tmps.items():
            tmp.replace(out / name)
    except OSError as e:
        for tmp in tmps.values():
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        where = e.filename or out
        raise ExportError(
            f"--out: cannot write {where} ({reason(e)}); nothing in {out} was changed: free some "
            "space or choose a writable --out"
        ) from None

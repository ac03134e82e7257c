"""Where tokens come from: the embedded corpus, text / JSONL files, or pre-tokenized token files."""
from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

import numpy as np


def embedded_corpus(max_bytes: int) -> bytes:
    """Python's own standard-library sources: present on every machine that runs us, no download.

    Files are taken in sorted order (deterministic for one Python version), skipping tests and
    installed third-party packages, until `max_bytes` are read.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idle_test", "encodings") for p in rel):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"embedded corpus: no Python sources under {root}; "
                                "use --config.data.source=text --config.data.path=...")
    return b"\n\n".join(parts)[:max_bytes]


def expand_paths(spec: str, field: str, suffixes: tuple[str, ...]) -> list[str]:
    """A file, a directory (its files with `suffixes`, sorted) or a glob; errors name the field."""
    if os.path.isdir(spec):
        paths = sorted(str(p) for p in Path(spec).rglob("*") if p.is_file() and p.name.endswith(suffixes))
    elif any(ch in spec for ch in "*?["):
        paths = sorted(glob.glob(spec))
    else:
        paths = [spec] if os.path.exists(spec) else []
    if not paths:
        raise FileNotFoundError(f"config field `{field}`: nothing found at {spec!r} "
                                f"(expected a file, a directory of {'/'.join(suffixes)} files, or a glob)")
    empty = [p for p in paths if os.path.getsize(p) == 0]
    if empty:
        raise ValueError(f"config field `{field}`: empty file(s): {empty[:3]}")
    return paths


def read_texts(paths: list[str], jsonl_field: str) -> list[str]:
    texts = []
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if jsonl_field not in record:
                        raise KeyError(f"{path}:{n}: no field {jsonl_field!r} (set data.jsonl_field)")
                    texts.append(record[jsonl_field])
        else:
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
    return texts


def token_files(paths: list[str], dtype: str) -> list[np.ndarray]:
    """Memory-mapped token files: raw .bin arrays of `dtype` (as common preprocessing scripts write)
    or .npy arrays; nothing is read into memory until a batch touches it."""
    arrays = []
    for path in paths:
        if path.endswith(".npy"):
            arrays.append(np.load(path, mmap_mode="r"))
        else:
            arrays.append(np.memmap(path, dtype=np.dtype(dtype), mode="r"))
    return arrays

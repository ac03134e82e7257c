"""Tokenising one work unit of `data.prepare` into one shard (`shard_NNNNN.bin/.idx/.json`), in a
worker process or in-process: the units, the token dtype, the tokenizer loaded once per process,
and the worker processes' set-up (they die with their parent and hold a shared lock on --out)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

from boost_jax.data.reading import read_documents, splittable
from boost_jax.data.shard_dir import WORKERS_LOCK, WriteError, error_reason, unlink_quietly
from boost_jax.data.tokenizer import load_tokenizer
from boost_jax.errors import PrepareError

BATCH_BYTES = 1 << 20  # documents per tokenizer call, by size


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    fits = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if requested == "auto":
        return fits
    if requested == "uint16" and fits == "uint32":
        raise PrepareError(f"--dtype uint16 cannot hold a vocabulary of {vocab_size}; use uint32 or auto")
    return requested


def plan_units(paths: list[str], unit_bytes: int) -> list[list[list]]:
    """Work units: lists of [path, start, end] byte ranges, in input order, about unit_bytes each."""
    units, current, size_now = [], [], 0
    for path in paths:
        size = os.path.getsize(path)
        step = unit_bytes if splittable(path) else size
        for start in range(0, size, max(step, 1)):
            end = min(size, start + step)
            if current and size_now + end - start > unit_bytes:
                units.append(current)
                current, size_now = [], 0
            current.append([path, start, end])
            size_now += end - start
    if current:
        units.append(current)
    return units


def _encode(tok, texts: list, ends: list[bool], dtype) -> tuple[np.ndarray, list[int]]:
    """(one array: each text's ids, then EOS where a document ends (if the tokenizer has one); the
    offset in it where each of those documents ends)."""
    eos = tok.eos_id
    ids = tok.encode_batch([t for t in texts if t is not None])
    parts, k, size, doc_ends = [], 0, 0, []
    for text, end in zip(texts, ends):
        if text is not None:
            parts.append(np.asarray(ids[k], dtype))
            size += len(parts[-1])
            k += 1
        if end and eos is not None:
            parts.append(np.array([eos], dtype))
            size += 1
        if end:
            doc_ends.append(size)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype)), doc_ends


_TOKENIZERS: dict = {}
_PROGRESS = None


_WORKERS_FD = None  # a worker's shared lock on OUT/.workers.lock, held for its lifetime
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies (a `kill -9` of the main
    process), so no worker outlives it to write into --out beside a rerun."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if parent and os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def init_worker(progress_queue, parent: int = 0, out: str = "") -> None:
    global _PROGRESS, _WORKERS_FD
    _PROGRESS = progress_queue
    _die_with_parent(parent)
    if out:  # a rerun on --out waits while any worker of this run is alive (main: wait_for_workers)
        _WORKERS_FD = os.open(Path(out) / WORKERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(_WORKERS_FD, fcntl.LOCK_SH)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent stops the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # which it does with SIGTERM
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (blocked while this process started)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process


def _tokenizer(spec: str):
    """Loaded once per process (and again if the file changes)."""
    key = (spec, os.stat(spec).st_mtime_ns if os.path.isfile(spec) else None)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(spec)
    return _TOKENIZERS[key]


def run_unit(index: int, pieces: list, out: str, tokenizer: str, field: str, dtype: str, progress=None) -> dict:
    """Tokenise one work unit into shard_{index}.bin/.idx/.json (each written as .tmp, then renamed);
    returns its counts. Writing errors are a WriteError naming the file; its .tmp files are removed."""
    tok, dtype = _tokenizer(tokenizer), np.dtype(dtype)
    out = Path(out)
    name = f"shard_{index:05d}"
    tmp = {ext: out / f"{name}.{ext}.tmp" for ext in ("bin", "idx", "json")}
    report = progress or (_PROGRESS.put if _PROGRESS is not None else None)
    docs = tokens = 0
    doc_ends: list[int] = []  # where each document ends, in tokens from the shard's start
    target = out / f"{name}.bin"  # the file being written, for the error message

    def write(block, ends):
        nonlocal docs, tokens
        f.write(np.ascontiguousarray(block).view(np.uint8))  # not tofile: its errors lose the errno
        doc_ends.extend(tokens + e for e in ends)
        docs, tokens = docs + len(ends), tokens + len(block)

    try:
        with open(tmp["bin"], "wb") as f:
            for path, start, end in pieces:
                texts, ends, size, reported = [], [], 0, 0
                for text, ended in read_documents(path, start, end, field):
                    texts.append(text)
                    ends.append(ended)
                    size += len(text) if text is not None else 0
                    if size >= BATCH_BYTES:
                        block, block_ends = _encode(tok, texts, ends, dtype)
                        write(block, block_ends)
                        step = min(size, end - start - reported)  # characters ~ input bytes, for the bar
                        reported += step
                        if report:
                            report((step, len(block)))
                        texts, ends, size = [], [], 0
                block, block_ends = _encode(tok, texts, ends, dtype)
                write(block, block_ends)
                if report:
                    report((end - start - reported, len(block)))
        # Document boundaries (Megatron's indexed datasets keep the same): int64 end offsets.
        if doc_ends and doc_ends[-1] != tokens:
            doc_ends.append(tokens)  # a last document with no end mark (cannot happen: every input ends one)
        target = out / f"{name}.idx"
        tmp["idx"].write_bytes(np.asarray(doc_ends, np.int64).tobytes())
        os.replace(tmp["idx"], target)
        target = out / f"{name}.bin"
        os.replace(tmp["bin"], target)
        meta = {
            "file": f"{name}.bin",
            "ends": f"{name}.idx",
            "documents": len(doc_ends),
            "tokens": tokens,
            "bytes": sum(e - s for _, s, e in pieces),
        }
        target = out / f"{name}.json"
        tmp["json"].write_text(json.dumps(meta))
        os.replace(tmp["json"], target)  # the shard counts as finished from here
    except OSError as e:
        unlink_quietly(tmp.values())
        raise WriteError(str(target), error_reason(e)) from None
    except BaseException:
        unlink_quietly(tmp.values())
        raise
    return meta

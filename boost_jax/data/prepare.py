"""Tokenise text / JSONL / Parquet corpora into token shards that `data.source=tokens` reads.

    python -m boost_jax.data.prepare /data/c4/en/*.json.gz --out /data/c4_t5 --tokenizer t5.model
    python -m boost_jax.train --config configs/cola_60m.py --config.data.path=/data/c4_t5 \\
        --config.data.tokenizer=t5.model

Inputs: files, directories or globs of `.jsonl`/`.json` (one JSON object per line, the text in
`--field`), `.txt`/`.md`/`.text` (a file is one document, tokenised in 8 MB pieces cut at line ends)
and `.parquet` (the `--field` column; needs pyarrow), each optionally `.gz` or `.zst` (needs
zstandard). Uncompressed JSONL is cut at line starts into work units of about `--unit-mb` MB, so one
large file still spreads over the worker processes; small files share a unit, and any other file is
one unit. Each unit streams through the tokenizer in batches of documents (memory stays bounded by
the batch, whatever the input size), every document ends with the tokenizer's EOS (the byte
tokenizer has none: its 256 ids are all bytes), and the unit becomes one raw shard
`shard_NNNNN.bin` of uint16 (vocabulary <= 65536) or uint32 tokens, with `shard_NNNNN.idx` the end
offset (int64, in tokens) of every document in it, so `data.batching=packed|document` finds
documents without scanning for EOS, and `shard_NNNNN.json` its counts, each written as `NAME.tmp`
and renamed when complete (the `.json` last: a shard is finished once it exists). A rerun
with the same arguments keeps the finished shards and redoes only the rest (`plan.json` records the
inputs and tokenizer, so a rerun with different ones is refused instead of mixing them). Last,
`index.json` lists the shards in input order with the tokenizer, vocabulary size, dtype, document
and token counts, which the `tokens` source checks against the run's config.

One run at a time per `--out`: a run holds an exclusive `flock` on `OUT/.lock` (which records its
pid and start time) while it works, so two runs never write the same `.tmp` files; a second one is
refused in one line naming the holder. The kernel drops the lock when its holder exits in any way.
Stopping: SIGINT (Ctrl-C) or SIGTERM stops the workers (they ignore SIGINT: the main process stops
the pool), keeps the finished shards, removes the unfinished units' `.tmp` files and exits with
status 130 (SIGINT) or 143 (SIGTERM) after one line saying how many shards are kept. A full disk (or
any other error writing under `--out`, here or in a worker) is one line naming the file and the
reason, with the same clean-up: free space and rerun the same command to resume. SIGKILL leaves
`.tmp` files behind, which are never read and are overwritten or removed by the next run; the
workers die with the main process (Linux: the kernel kills them when it dies), and while any is
alive it holds a shared lock on `OUT/.workers.lock` for which a rerun waits before it writes.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import gzip
import io
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from boost_jax.data.sources import FORMAT, INDEX
from boost_jax.data.tokenizer import tokenizer_id
from boost_jax.errors import PrepareError

PLAN = "plan.json"
TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
TEXT_CHUNK = 8 << 20  # a text file is tokenised in pieces of this many bytes, cut at line ends
BATCH_BYTES = 1 << 20  # documents per tokenizer call, by size
LOCK = ".lock"


class Interrupted(KeyboardInterrupt):
    """prepare() stopped by SIGINT/SIGTERM (or KeyboardInterrupt); args: (signal name, shards done, planned)."""


class _Stop(KeyboardInterrupt):
    """Raised by main()'s SIGTERM handler, to stop like Ctrl-C; args: (signal number,)."""


class _WriteError(Exception):
    """An OSError writing under --out (args: path, reason), here or in a worker (it pickles)."""


def _why(e: BaseException) -> str:
    """An OSError's errno text, e.g. 'No space left on device [ENOSPC]'."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]"
    return str(e) or type(e).__name__


def _unlink(paths) -> None:
    for path in paths:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError:
            pass


def _write_file(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (into path.tmp, then renamed); an OSError is a _WriteError."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        _unlink([tmp])
        raise _WriteError(str(path), _why(e)) from None


def file_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path[:-4] if path.endswith(".zst") else path
    if name.endswith((".jsonl", ".json")):
        return JSONL
    return PARQUET if name.endswith(".parquet") else TEXT


def _splittable(path: str) -> bool:
    """Only uncompressed JSONL is cut into ranges (at line starts): a text file is one document."""
    return file_format(path) == JSONL and not path.endswith((".gz", ".zst"))


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
        step = unit_bytes if _splittable(path) else size
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


# ---------------------------------------------------------------- reading (in the workers)


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise PrepareError(f"{path}: reading .zst needs zstandard: pip install zstandard") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def _lines(f, start: int, end: int):
    """(offset, line) for the lines that start in [start, end): each line belongs to one range."""
    if start:
        f.seek(start - 1)
        f.readline()  # the rest of a line that began in the previous range
    pos = f.tell() if start else 0
    while pos < end:
        line = f.readline()
        if not line:
            return
        yield pos, line
        pos += len(line)


def _line_of(path: str, pos: int) -> str:
    """PATH:LINE of the line starting at byte `pos` of the (decompressed) file; for error messages."""
    newlines, done = 0, 0
    with _open(path) as f:
        while done < pos:
            chunk = f.read(min(1 << 20, pos - done))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            done += len(chunk)
    return f"{path}:{newlines + 1}"


def _documents(path: str, start: int, end: int, field: str):
    """(text, ends_document) pieces of one byte range; text None only marks a document's end."""
    fmt = file_format(path)
    if fmt == PARQUET:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
        parquet = pq.ParquetFile(path)
        if field not in parquet.schema_arrow.names:
            raise PrepareError(
                f"{path}: no column {field!r} (columns: {parquet.schema_arrow.names}); set --field (data.jsonl_field)"
            )
        for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield str(text), True
        return
    with _open(path) as f:
        if fmt == JSONL:
            for pos, line in _lines(f, start, end if _splittable(path) else float("inf")):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except UnicodeDecodeError as e:
                    raise PrepareError(
                        f"{_line_of(path, pos)}: not valid UTF-8 (byte {e.start} of the line); "
                        "re-encode the file as UTF-8"
                    ) from None
                except ValueError as e:
                    raise PrepareError(
                        f"{_line_of(path, pos)}: not JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')})"
                    ) from None
                if not isinstance(record, dict):
                    raise PrepareError(
                        f"{_line_of(path, pos)}: a JSON {type(record).__name__}, not an object with a {field!r} field"
                    )
                if field not in record:
                    raise PrepareError(
                        f"{_line_of(path, pos)}: no field {field!r} (its fields: "
                        f"{sorted(record)[:6]}); set data.jsonl_field (prepare: --field)"
                    )
                text = record[field]
                if not isinstance(text, str):
                    raise PrepareError(
                        f"{_line_of(path, pos)}: field {field!r} is not a string but {type(text).__name__}"
                    )
                yield text, True
            return
        piece, piece_start = [], 0  # the whole file, in pieces of whole lines that bound the memory
        for pos, line in _lines(f, 0, float("inf")):
            if not piece:
                piece_start = pos
            piece.append(line)
            if pos + len(line) - piece_start >= TEXT_CHUNK:
                yield _decode(b"".join(piece), path, piece_start), False
                piece = []
        yield (_decode(b"".join(piece), path, piece_start) if piece else None), True


def _read(path: str, start: int, end: int, field: str):
    """_documents, with an unreadable input (I/O error, corrupt .gz) as a one-line error naming it."""
    try:
        yield from _documents(path, start, end, field)
    except (OSError, EOFError) as e:
        raise PrepareError(f"{path}: cannot read it ({_why(e)}); fix or replace that input") from None


def _decode(data: bytes, path: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = offset + e.start
        raise PrepareError(
            f"{_line_of(path, at)}: not valid UTF-8 (byte {at} of the file); re-encode the file as UTF-8"
        ) from None


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
WORKERS_LOCK = ".workers.lock"
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


def _init_worker(progress_queue, parent: int = 0, out: str = "") -> None:
    global _PROGRESS, _WORKERS_FD
    _PROGRESS = progress_queue
    _die_with_parent(parent)
    if out:  # a rerun on --out waits while any worker of this run is alive (main: _wait_for_workers)
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
        from boost_jax.data.tokenizer import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(spec)
    return _TOKENIZERS[key]


def run_unit(index: int, pieces: list, out: str, tokenizer: str, field: str, dtype: str, progress=None) -> dict:
    """Tokenise one work unit into shard_{index}.bin/.idx/.json (each written as .tmp, then renamed);
    returns its counts. Writing errors are a _WriteError naming the file; its .tmp files are removed."""
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
                for text, ended in _read(path, start, end, field):
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
        _unlink(tmp.values())
        raise _WriteError(str(target), _why(e)) from None
    except BaseException:
        _unlink(tmp.values())
        raise
    return meta


# ---------------------------------------------------------------- driver


class _OutLock:
    """An exclusive flock on OUT/.lock while one prepare() writes there (the file names its holder)."""

    def __init__(self, out: Path):
        self.out, self._fd = out, None

    def __enter__(self):
        try:
            fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PrepareError(
                f"--out {self.out}: cannot write {self.out / LOCK} ({_why(e)}); choose a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.read(fd, 4096))
                who = f"pid {holder['pid']}, since {holder['since']}"
            except (OSError, ValueError, KeyError, TypeError):
                who = "pid unknown"
            os.close(fd)
            raise PrepareError(
                f"another data.prepare is writing {self.out} ({who}); wait for it or choose another --out"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        except OSError:
            pass  # (a full disk) the lock holds all the same; only its note on the holder is missing
        self._fd = fd
        return self

    def __exit__(self, *exc):
        os.close(self._fd)  # drops the flock; the file stays (its text only names the holder)


def _make_out(out: Path) -> None:
    """Create --out (and its parents), with a one-line error where a file is in the way."""
    for p in (out, *out.parents):
        if p.exists():  # the deepest existing one
            if not p.is_dir():
                where = "is a file" if p == out else f"is under the file {p}"
                raise PrepareError(f"--out {out} {where}, not a directory; choose a directory (created if missing)")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"--out {out}: cannot create it ({_why(e)}); choose a writable directory") from None


def _wait_for_workers(out: Path, say=lambda text: print(text, file=sys.stderr)) -> None:
    """Wait until no worker of an earlier run on `out` is alive (each holds a shared lock on
    OUT/.workers.lock; they die with their main process, so this is short)."""
    try:
        fd = os.open(out / WORKERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # (an unwritable --out is reported where the run first writes)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"note: waiting for the workers of an earlier data.prepare on {out} to exit")
            fcntl.flock(fd, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _remove_tmp(out: Path) -> None:
    """The .tmp files of unfinished units (only ever ours: the caller holds the lock)."""
    _unlink(p for p in out.glob("*.tmp") if p.name.startswith("shard_") or p.name in (f"{PLAN}.tmp", f"{INDEX}.tmp"))


@contextlib.contextmanager
def _workers_starting():
    """While the worker processes start: SIGINT is blocked (they inherit the mask through exec, then
    ignore SIGINT, so a Ctrl-C while they import prints no traceback there), and a SIGINT or SIGTERM
    for this process is noted and raised again afterwards (so it cannot cut a worker's start in half)."""
    noted = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {
            s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
        }
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a SIGINT held back arrives now, noted
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in dict.fromkeys(noted):
            signal.raise_signal(s)


def prepare(
    paths: list[str],
    out,
    tokenizer: str = "byte",
    *,
    field: str = "text",
    workers: int = 0,
    dtype: str = "auto",
    unit_bytes: int = 64 << 20,
    progress: bool = True,
    tok_id: str | None = None,
) -> dict:
    """Tokenise `paths` into shards under `out` (resuming a previous run of the same plan); returns
    the index. workers=0 tokenises in this process, N > 0 in N spawned worker processes. Holds
    OUT/.lock throughout; a KeyboardInterrupt becomes Interrupted and a failed write a PrepareError,
    both after removing the unfinished units' .tmp files (the finished shards stay). `tok_id`: the
    tokenizer's identity (tokenizer_id), when the caller has it already."""
    from boost_jax.data.tokenizer import load_tokenizer

    if not unit_bytes >= 1:
        raise PrepareError(f"--unit-mb: {unit_bytes} bytes per work unit; give a number of MB > 0 (e.g. 64)")
    if workers < 0:
        raise PrepareError(f"--workers {workers}: give 0 (tokenise in this process) or a number of processes")
    tok = load_tokenizer(tokenizer, field="--tokenizer")
    dtype = token_dtype(tok.vocab_size, dtype)
    out = Path(out)
    _make_out(out)
    units = plan_units([str(p) for p in paths], unit_bytes)
    tok_id = tok_id or tokenizer_id(tokenizer)
    plan = {
        "format": FORMAT,
        "tokenizer": tok_id,
        "field": field,
        "dtype": dtype,
        "inputs": [[str(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths],
        "units": units,
    }
    with _OutLock(out):
        return _prepare_locked(out, tok, units, plan, tokenizer, field, dtype, workers, progress, tok_id)


def _prepare_locked(
    out: Path,
    tok,
    units: list,
    plan: dict,
    tokenizer: str,
    field: str,
    dtype: str,
    workers: int,
    progress: bool,
    tok_id: str,
) -> dict:
    """prepare() under the lock: the plan, the units still to do, the index; the clean-up on a stop."""
    from tqdm import tqdm

    bar = None
    _wait_for_workers(out)
    try:
        if (out / PLAN).exists():
            try:
                same = json.loads((out / PLAN).read_text()) == plan
            except ValueError:
                same = False
            if not same:
                raise PrepareError(
                    f"{out} holds a preparation of other inputs or with another tokenizer, --field, "
                    f"--dtype or --unit-mb ({out / PLAN}); choose a new --out or delete that directory"
                )
        else:
            _write_file(out / PLAN, json.dumps(plan, indent=1).encode())
        (out / INDEX).unlink(missing_ok=True)

        metas = {
            i: json.loads((out / f"shard_{i:05d}.json").read_text())
            for i in range(len(units))
            if (out / f"shard_{i:05d}.json").exists()
        }
        todo = [i for i in range(len(units)) if i not in metas]
        total = sum(e - s for u in units for _, s, e in u)
        bar = tqdm(
            total=total,
            initial=sum(m["bytes"] for m in metas.values()),
            unit="B",
            unit_scale=True,
            desc=f"tokenising ({len(metas)}/{len(units)} shards done)" if metas else "tokenising",
            disable=not progress,
            dynamic_ncols=True,
        )
        t0, new_tokens = time.perf_counter(), 0

        def advance(step):
            nonlocal new_tokens
            new_tokens += step[1]
            bar.update(step[0])
            bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s", refresh=False)

        args = (str(out), tokenizer, field, dtype)
        if workers == 0:
            for i in todo:
                metas[i] = run_unit(i, units[i], *args, progress=advance)
        elif todo:
            ctx = multiprocessing.get_context("spawn")  # no fork of a process that may run JAX threads
            queue = ctx.Queue()  # first: starting multiprocessing's resource tracker unblocks SIGINT
            pool = None
            try:
                with _workers_starting():  # a signal meanwhile is raised once `pool` is set
                    pool = ctx.Pool(
                        min(workers, len(todo)), initializer=_init_worker, initargs=(queue, os.getpid(), str(out))
                    )
                pending = {i: pool.apply_async(run_unit, (i, units[i], *args)) for i in todo}
                while pending:
                    while not queue.empty():
                        advance(queue.get())
                    for i in [i for i, r in pending.items() if r.ready()]:
                        metas[i] = pending.pop(i).get()  # re-raises a worker's error here
                    time.sleep(0.05)
                while not queue.empty():
                    advance(queue.get())
            finally:
                if pool is not None:
                    pool.terminate()  # also after an error or a signal: stops (and joins) the workers
        bar.update(bar.total - bar.n)  # reports still in flight when the last unit returned
        bar.close()  # before any message
        seconds = time.perf_counter() - t0
        shards = [metas[i] for i in range(len(units))]
        index = {
            "format": FORMAT,
            "tokenizer": tokenizer,
            "tokenizer_id": tok_id,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": dtype,
            "field": field,
            "documents": sum(m["documents"] for m in shards),
            "tokens": sum(m["tokens"] for m in shards),
            "bytes": total,
            "shards": shards,
        }
        _write_file(out / INDEX, json.dumps(index, indent=1).encode())
        _remove_tmp(out)  # any left by a killed run
    except BaseException as e:
        if bar is not None:
            bar.close()
        _remove_tmp(out)  # the workers are stopped by now
        done = sum((out / f"shard_{i:05d}.json").exists() for i in range(len(units)))
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(
                signal.Signals(e.args[0]).name if isinstance(e, _Stop) else "SIGINT", done, len(units)
            ) from None
        if isinstance(e, (_WriteError, OSError)):
            path, why = e.args if isinstance(e, _WriteError) else (e.filename or out, _why(e))
            fix = "free some space" if "ENOSPC" in why or "EDQUOT" in why else "fix that"
            raise PrepareError(
                f"cannot write {path}: {why}; {done} of {len(units)} shards are done and kept in "
                f"{out}: {fix} and rerun the same command to resume"
            ) from None
        raise
    index["seconds"] = seconds  # this invocation's time (not stored: a resumed run did less work)
    return index


def input_files(specs: list[str]) -> list[str]:
    from boost_jax.data.sources import expand_paths

    suffixes = tuple(
        s + c for s in (".jsonl", ".json", ".txt", ".md", ".text", ".parquet") for c in ("", ".gz", ".zst")
    )
    paths = []
    for spec in specs:
        try:
            paths += expand_paths(spec, "inputs", suffixes)
        except FileNotFoundError:
            raise PrepareError(
                f"inputs: nothing found at {spec!r} (give files, globs, or directories of "
                ".jsonl/.json/.txt/.md/.text/.parquet files, each optionally .gz or .zst)"
            ) from None
    return paths


_stopping = False


def _stop(signum, frame):
    """main()'s SIGTERM handler: stop like Ctrl-C, once (a second SIGTERM must not break the clean-up;
    not SIG_IGN, which worker processes started meanwhile would inherit, and then outlive the pool)."""
    global _stopping
    if not _stopping:
        _stopping = True
        raise _Stop(signum)


def main(argv=None) -> int:
    """The command line; exit status 0, 1 on an error, 130 after SIGINT and 143 after SIGTERM."""
    try:
        return _cli(argv)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            name, kept = e.args[0], f"{e.args[1]} of {e.args[2]} shards are done and kept"
        else:  # before the shards were planned
            name, kept = signal.Signals(e.args[0]).name if isinstance(e, _Stop) else "SIGINT", "nothing new was written"
        print(f"error: interrupted ({name}); {kept}: rerun the same command to resume", file=sys.stderr)
        return 128 + signal.Signals[name]


def _cli(argv) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("inputs", nargs="+", help="files, directories or globs")
    ap.add_argument("--out", required=True, help="the directory of shards (rerun with it to resume)")
    ap.add_argument("--tokenizer", default="byte", help="byte | a HF tokenizers .json | a SentencePiece .model")
    ap.add_argument("--field", default="text", help="the JSONL field / Parquet column holding the text")
    ap.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenizer processes (0: this process); default: all cores",
    )
    ap.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"))
    ap.add_argument("--unit-mb", type=float, default=64, help="input MB per work unit and shard")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.workers < 0:
        print(
            f"error: --workers {args.workers}: give 0 (tokenise in this process) or a number of worker processes",
            file=sys.stderr,
        )
        return 1
    if not math.isfinite(args.unit_mb) or args.unit_mb * (1 << 20) < 1:
        print(
            f"error: --unit-mb {args.unit_mb:g}: give the input MB per work unit, a number > 0 (e.g. 64)",
            file=sys.stderr,
        )
        return 1
    global _stopping
    _stopping = False
    try:
        previous = signal.signal(signal.SIGTERM, _stop) or signal.SIG_DFL
    except ValueError:  # not the main thread (main() called from a thread): SIGTERM stays as it is
        previous = None
    try:
        paths = input_files(args.inputs)
        first: dict[str, str] = {}
        for path in paths:  # compared resolved: `c.jsonl` and `./c.jsonl` (or a link to it) are one file
            real = os.path.realpath(path)
            if real in first:
                same = "" if first[real] == path else f" (as {first[real]} and {path})"
                raise PrepareError(f"inputs: {path} is named twice{same}; give each file once")
            first[real] = path
        index = prepare(
            paths,
            args.out,
            args.tokenizer,
            field=args.field,
            workers=args.workers,
            dtype=args.dtype,
            unit_bytes=int(args.unit_mb * (1 << 20)),
            progress=not args.no_progress,
        )
    except (PrepareError, FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # anything not worded above (an unreadable input directory, ...)
        print(f"error: {e.filename or args.out}: {_why(e)}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(
        f"wrote {len(index['shards'])} shards, {index['documents']:,} documents, {index['tokens']:,} "
        f"{index['dtype']} tokens to {args.out} ({index['seconds']:.1f} s)\n"
        f"train: --config.data.source=tokens --config.data.path={args.out} "
        f"--config.data.token_dtype={index['dtype']} --config.data.tokenizer={args.tokenizer or 'byte'}\n"
        f"(a validation split: --config.data.eval_path={args.out} instead of data.path)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

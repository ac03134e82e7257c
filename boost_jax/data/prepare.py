"""Tokenise text / JSONL / Parquet corpora into token shards that `data.source=tokens` reads.

    python -m boost_jax.data.prepare /data/c4/en/*.json.gz --out /data/c4_t5 --tokenizer t5.model
    python -m boost_jax.train --config configs/cola_60m.py --config.data.path=/data/c4_t5 \\
        --config.data.tokenizer=t5.model

Each input unit becomes one raw shard `shard_NNNNN.bin` (uint16 or uint32 tokens, every document
ending with the tokenizer's EOS) with `.idx` (document end offsets) and `.json` (counts, written
last: a shard is finished once it exists); `index.json` lists the shards with the tokenizer,
vocabulary size and dtype, which the `tokens` source checks against the run's config. A rerun with
the same arguments resumes; one run at a time holds `OUT/.lock`; SIGINT/SIGTERM or a failed write
keep the finished shards and remove the rest. The whole contract: `DETAILS` (the command's --help).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

from boost_jax.data.shard_dir import (
    PLAN,
    OutLock,
    WriteError,
    error_reason,
    make_out,
    remove_tmp,
    wait_for_workers,
    write_whole,
)
from boost_jax.data.shards import (
    init_worker,
    plan_units,
    run_unit,
    token_dtype,
)
from boost_jax.data.sources import FORMAT, INDEX, expand_paths
from boost_jax.data.tokenizer import load_tokenizer, tokenizer_id
from boost_jax.errors import PrepareError

DETAILS = """\
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


class Interrupted(KeyboardInterrupt):
    """prepare() stopped by SIGINT/SIGTERM (or KeyboardInterrupt); args: (signal name, shards done, planned)."""


class _Stop(KeyboardInterrupt):
    """Raised by main()'s SIGTERM handler, to stop like Ctrl-C; args: (signal number,)."""


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
    if not unit_bytes >= 1:
        raise PrepareError(f"--unit-mb: {unit_bytes} bytes per work unit; give a number of MB > 0 (e.g. 64)")
    if workers < 0:
        raise PrepareError(f"--workers {workers}: give 0 (tokenise in this process) or a number of processes")
    tok = load_tokenizer(tokenizer, field="--tokenizer")
    dtype = token_dtype(tok.vocab_size, dtype)
    out = Path(out)
    make_out(out)
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
    with OutLock(out):
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
    bar = None
    wait_for_workers(out)
    try:
        _check_plan(out, plan)
        metas = _finished_shards(out, len(units))
        todo = [i for i in range(len(units)) if i not in metas]
        total = sum(e - s for u in units for _, s, e in u)
        bar = _progress_bar(total, len(units), metas, progress)
        t0 = time.perf_counter()
        advance = _advance(bar, t0)
        args = (str(out), tokenizer, field, dtype)
        if workers == 0:
            for i in todo:
                metas[i] = run_unit(i, units[i], *args, progress=advance)
        elif todo:
            _run_in_workers(todo, units, args, workers, out, metas, advance)
        bar.update(bar.total - bar.n)  # reports still in flight when the last unit returned
        bar.close()  # before any message
        seconds = time.perf_counter() - t0
        index = _index(tok, tokenizer, tok_id, dtype, field, total, [metas[i] for i in range(len(units))])
        write_whole(out / INDEX, json.dumps(index, indent=1).encode())
        remove_tmp(out)  # any left by a killed run
    except BaseException as e:
        if bar is not None:
            bar.close()
        remove_tmp(out)  # the workers are stopped by now
        error = _stopped(e, out, len(units))
        if error is None:
            raise
        raise error from None
    index["seconds"] = seconds  # this invocation's time (not stored: a resumed run did less work)
    return index


def _check_plan(out: Path, plan: dict) -> None:
    """Write OUT/plan.json, or refuse a directory whose plan differs (other inputs, tokenizer, ...);
    drop the index (it is written again last)."""
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
        write_whole(out / PLAN, json.dumps(plan, indent=1).encode())
    (out / INDEX).unlink(missing_ok=True)


def _finished_shards(out: Path, n_units: int) -> dict:
    """{unit: its shard's counts} for the shards an earlier run finished (their .json exists)."""
    return {
        i: json.loads((out / f"shard_{i:05d}.json").read_text())
        for i in range(n_units)
        if (out / f"shard_{i:05d}.json").exists()
    }


def _progress_bar(total: int, n_units: int, metas: dict, progress: bool):
    """The tqdm bar over the input bytes, starting at what the finished shards cover."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=sum(m["bytes"] for m in metas.values()),
        unit="B",
        unit_scale=True,
        desc=f"tokenising ({len(metas)}/{n_units} shards done)" if metas else "tokenising",
        disable=not progress,
        dynamic_ncols=True,
    )


def _advance(bar, t0: float):
    """The progress callback: a (bytes, tokens) step moves the bar and updates the tokens/s."""
    new_tokens = 0

    def advance(step):
        nonlocal new_tokens
        new_tokens += step[1]
        bar.update(step[0])
        bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s", refresh=False)

    return advance


def _run_in_workers(todo: list, units: list, args: tuple, workers: int, out: Path, metas: dict, advance) -> None:
    """Tokenise the units `todo` in a pool of spawned worker processes, their counts into `metas`; the
    pool is stopped on the way out, also after an error or a signal."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may run JAX threads
    queue = ctx.Queue()  # first: starting multiprocessing's resource tracker unblocks SIGINT
    pool = None
    try:
        with _workers_starting():  # a signal meanwhile is raised once `pool` is set
            pool = ctx.Pool(min(workers, len(todo)), initializer=init_worker, initargs=(queue, os.getpid(), str(out)))
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


def _index(tok, tokenizer: str, tok_id: str, dtype: str, field: str, total: int, shards: list) -> dict:
    """index.json: the shards in input order with the tokenizer, vocabulary, dtype and counts."""
    return {
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


def _stopped(e: BaseException, out: Path, n_units: int) -> BaseException | None:
    """What a stopped run raises (the .tmp files removed): Interrupted for a signal or Ctrl-C, a
    PrepareError naming the file for a failed write; None: `e` itself."""
    done = sum((out / f"shard_{i:05d}.json").exists() for i in range(n_units))
    if isinstance(e, KeyboardInterrupt):
        return Interrupted(signal.Signals(e.args[0]).name if isinstance(e, _Stop) else "SIGINT", done, n_units)
    if isinstance(e, (WriteError, OSError)):
        path, why = e.args if isinstance(e, WriteError) else (e.filename or out, error_reason(e))
        fix = "free some space" if "ENOSPC" in why or "EDQUOT" in why else "fix that"
        return PrepareError(
            f"cannot write {path}: {why}; {done} of {n_units} shards are done and kept in "
            f"{out}: {fix} and rerun the same command to resume"
        )
    return None


def input_files(specs: list[str]) -> list[str]:
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
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"{__doc__}\n{DETAILS}",
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
        print(f"error: {e.filename or args.out}: {error_reason(e)}", file=sys.stderr)
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

"""`python -m boost_jax.data.prepare`: shards equal in-process tokenisation (EOS per document, input
order, units cut inside files), an interrupted run resumes keeping its finished shards, and the
`tokens` source refuses shards that do not match the run (dtype, vocabulary, tokenizer)."""

import errno
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boost_jax.data import build_loaders, shards
from boost_jax.data import prepare as prep
from boost_jax.data.shard_dir import OutLock
from boost_jax.data.tokenizer import load_tokenizer
from boost_jax.errors import PrepareError


def _documents(rng, n):
    words = ["alpha", "beta", "naïve", "über", "训练", "data", "token", "é", "\\n", "the", "of"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.integers(1, 80))) + ("\n" if i % 7 == 0 else "") for i in range(n)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL file (with blank lines and extra fields), a gzipped JSONL, two text files; the texts in order."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = _documents(rng, 300)
    with open(root / "a.jsonl", "w") as f:
        for i, d in enumerate(docs[:200]):
            f.write(json.dumps({"id": i, "text": d}) + "\n" + ("\n" if i % 50 == 0 else ""))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        for d in docs[200:]:
            f.write(json.dumps({"text": d}) + "\n")
    texts = ["first file\n" + "\n".join(docs[:40]), "second file, no newline at the end: " + docs[41]]
    (root / "c.txt").write_text(texts[0])
    (root / "d.txt").write_text(texts[1])
    return root, docs + texts


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(
        corpus[1],
        tokenizers.trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<unk>", "</s>"],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tok.save(str(path))
    return str(path)


def reference(texts, spec):
    """In-process tokenisation: each document's ids, then EOS (when the tokenizer has one)."""
    tok = load_tokenizer(spec)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    return np.array([i for t in texts for i in list(tok.encode(t)) + eos], np.int64)


def stream(out):
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], index["dtype"]) for s in index["shards"]]).astype(np.int64)


def inputs(root):
    return [str(root / n) for n in ("a.jsonl", "b.jsonl.gz", "c.txt", "d.txt")]


@pytest.mark.parametrize("tokenizer, workers", [("byte", 0), ("bpe", 2)])
def test_shards_equal_in_process_tokenisation(corpus, bpe, tmp_path, tokenizer, workers):
    root, texts = corpus
    spec = bpe if tokenizer == "bpe" else "byte"
    # 3 kB units cut a.jsonl and c.txt into several shards each, at arbitrary byte offsets.
    index = prep.prepare(inputs(root), tmp_path / "out", spec, workers=workers, unit_bytes=3000, progress=False)
    assert len(index["shards"]) > 8 and index["dtype"] == "uint16"
    np.testing.assert_array_equal(stream(tmp_path / "out"), reference(texts, spec))
    assert index["documents"] == len(texts) and index["tokens"] == len(reference(texts, spec))
    assert index["vocab_size"] == load_tokenizer(spec).vocab_size
    if tokenizer == "bpe":
        assert index["eos_id"] == 1 and (stream(tmp_path / "out") == 1).sum() == len(texts)


def test_resume_after_an_interrupted_run(corpus, tmp_path, monkeypatch):
    root, texts = corpus
    out = tmp_path / "out"
    real = shards.run_unit

    def interrupted(i, *args, **kw):
        if i == 3:
            (out / f"shard_{i:05d}.bin.tmp").write_bytes(b"partial")  # killed while writing this shard
            raise KeyboardInterrupt
        return real(i, *args, **kw)

    monkeypatch.setattr(prep, "run_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(inputs(root), out, unit_bytes=3000, progress=False)
    assert sorted(p.name for p in out.glob("shard_*.json")) == [f"shard_0000{i}.json" for i in range(3)]
    with pytest.raises(ValueError, match="unfinished"):  # the tokens source does not read a half-made dir
        build_loaders(_tokens_config(out, tmp_path))
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[0-2].*")}

    monkeypatch.setattr(prep, "run_unit", real)
    prep.prepare(inputs(root), out, unit_bytes=3000, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[0-2].*")} == kept  # finished shards kept
    assert not list(out.glob("*.tmp"))
    np.testing.assert_array_equal(stream(out), reference(texts, "byte"))

    # Another tokenizer, field or input set in the same directory is refused, not mixed in.
    with pytest.raises(PrepareError, match="choose a new --out"):
        prep.prepare(inputs(root)[:2], out, unit_bytes=3000, progress=False)


def _tokens_config(out, tmp_path, **overrides):
    from conftest import small_config

    return small_config(tmp_path / "run", **{"data.source": "tokens", "data.path": str(out), **overrides})


def test_tokens_source_reads_and_checks_the_index(corpus, bpe, tmp_path):
    root, texts = corpus
    out = tmp_path / "out"
    prep.prepare(inputs(root), out, bpe, unit_bytes=3000, progress=False)
    want = reference(texts, bpe)
    train, held, tok = build_loaders(_tokens_config(out, tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400}))
    assert 300 < tok.vocab_size <= 400 and all(isinstance(s, np.memmap) for s in train.segments)
    row = train.batch(0)[0]  # a window of the token stream
    assert any(np.array_equal(want[s : s + len(row)], row) for s in np.flatnonzero(want == row[0]))
    # The index itself also works as data.path.
    assert (
        build_loaders(_tokens_config(out / "index.json", tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400}))[
            0
        ].n
        == train.n
    )

    for overrides, field in [
        ({"data.token_dtype": "uint32"}, "data.token_dtype"),
        ({"model.vocab_size": 300}, "model.vocab_size"),
        ({"data.tokenizer": "byte"}, "data.tokenizer"),
    ]:
        cfg = _tokens_config(out, tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400, **overrides})
        with pytest.raises(ValueError, match=f"config field `{field}`"):
            build_loaders(cfg)

    (out / "shard_00002.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="shard_00002.bin: 2 bytes"):
        build_loaders(_tokens_config(out, tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400}))


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    assert prep.main([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o"), "--workers", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err == (
        f"error: {tmp_path / 'bad.jsonl'}:2: no field 'text' (its fields: ['body']); "
        "set data.jsonl_field (prepare: --field)"
    )
    assert prep.main([str(tmp_path / "none*.jsonl"), "--out", str(tmp_path / "o")]) == 1
    assert "inputs: nothing found" in capsys.readouterr().err
    assert (
        prep.main(
            [
                str(tmp_path / "bad.jsonl"),
                "--out",
                str(tmp_path / "o2"),
                "--dtype",
                "uint16",
                "--tokenizer",
                str(tmp_path / "missing.json"),
            ]
        )
        == 1
    )
    assert "--tokenizer: no file at" in capsys.readouterr().err  # the flag given, not the config field


def test_zst_and_parquet_inputs(corpus, tmp_path, capsys):
    root, texts = corpus
    docs = texts[:200]
    for name, fmt in (("z.jsonl.zst", "zstandard"), ("p.parquet", "pyarrow")):
        try:
            __import__(fmt)
        except ImportError:  # without the library the input is refused in one line
            (tmp_path / name).write_bytes(b"x")
            assert prep.main([str(tmp_path / name), "--out", str(tmp_path / f"o_{fmt}"), "--workers", "0"]) == 1
            assert f"pip install {fmt}" in capsys.readouterr().err
            continue
        if fmt == "zstandard":
            import zstandard

            lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
            (tmp_path / name).write_bytes(zstandard.ZstdCompressor().compress(lines))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": docs}), tmp_path / name, row_group_size=64)
        prep.prepare([str(tmp_path / name)], tmp_path / f"o_{fmt}", progress=False)
        np.testing.assert_array_equal(stream(tmp_path / f"o_{fmt}"), reference(docs, "byte"))


def test_text_sources_tokenise_once_into_a_cache(corpus, bpe, tmp_path):
    from conftest import small_config

    root, texts = corpus
    cfg = small_config(
        tmp_path / "run",
        **{"data.source": "jsonl", "data.path": str(root / "a.jsonl"), "data.tokenizer": bpe, "model.vocab_size": 400},
    )
    first = build_loaders(cfg)[0]
    cache = list((tmp_path / "run" / "token_cache").glob("*/index.json"))
    assert len(cache) == 1 and json.loads(cache[0].read_text())["documents"] == 200
    stamp = cache[0].stat().st_mtime_ns
    again = build_loaders(cfg)[0]  # a restart memory-maps the cache instead of tokenising again
    assert cache[0].stat().st_mtime_ns == stamp and isinstance(again.segments[0], np.memmap)
    np.testing.assert_array_equal(again.batch(3), first.batch(3))
    held = np.concatenate([np.asarray(s) for s in first.segments]).astype(np.int64)
    want = reference(texts[:200], bpe)
    np.testing.assert_array_equal(held, want[: len(held)])  # the training part: the stream's head

    os.utime(root / "a.jsonl")  # a changed input gets a new cache entry
    build_loaders(cfg)
    assert len(list((tmp_path / "run" / "token_cache").glob("*/index.json"))) == 2


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--unit-mb", "0"], "error: --unit-mb 0: give the input MB per work unit, a number > 0 (e.g. 64)"),
        (["--unit-mb", "-2"], "error: --unit-mb -2: "),
        (["--unit-mb", "nan"], "error: --unit-mb nan: "),
        (["--unit-mb", "inf"], "error: --unit-mb inf: "),
        (["--workers", "-1"], "error: --workers -1: give 0 (tokenise in this process) or a number of worker processes"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, capsys, flags, says):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n')
    assert prep.main([str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o"), "--no-progress", *flags]) == 1
    assert _one_line(capsys).startswith(says)
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_out_in_the_way_and_unreadable_inputs_are_one_line(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "file").write_text("x")
    args = [str(tmp_path / "a.jsonl"), "--no-progress", "--workers", "0", "--out"]
    assert prep.main([*args, str(tmp_path / "file")]) == 1
    assert _one_line(capsys) == (
        f"error: --out {tmp_path / 'file'} is a file, not a directory; choose a directory (created if missing)"
    )
    assert prep.main([*args, str(tmp_path / "file" / "sub" / "o")]) == 1
    assert _one_line(capsys) == (
        f"error: --out {tmp_path / 'file' / 'sub' / 'o'} is under the file "
        f"{tmp_path / 'file'}, not a directory; choose a directory (created if missing)"
    )
    (tmp_path / "b.jsonl.gz").write_bytes(b"not gzip")
    for workers in ("0", "1"):
        assert (
            prep.main(
                [
                    str(tmp_path / "b.jsonl.gz"),
                    "--no-progress",
                    "--workers",
                    workers,
                    "--out",
                    str(tmp_path / f"o{workers}"),
                ]
            )
            == 1
        )
        assert _one_line(capsys).startswith(f"error: {tmp_path / 'b.jsonl.gz'}: cannot read it (Not a gzipped file")


def test_disk_full_keeps_the_finished_shards_and_resumes(corpus, tmp_path, monkeypatch, capsys):
    root, texts = corpus
    out = tmp_path / "out"
    command = [*inputs(root), "--out", str(out), "--workers", "0", "--no-progress", "--unit-mb", str(3000 / (1 << 20))]
    real = os.replace

    def replace(src, dst):  # the disk fills up while shard 2 is finished, then while the index is
        if Path(dst).name in full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    full = {"shard_00002.bin"}
    assert prep.main(command) == 1
    n = len(json.loads((out / "plan.json").read_text())["units"])
    assert _one_line(capsys) == (
        f"error: cannot write {out / 'shard_00002.bin'}: No space left on device [ENOSPC]; "
        f"2 of {n} shards are done and kept in {out}: free some space and rerun the same "
        "command to resume"
    )
    assert sorted(p.name for p in out.glob("shard_*.json")) == ["shard_00000.json", "shard_00001.json"]
    assert not list(out.glob("*.tmp")) and not (out / "index.json").exists()

    full = {"index.json"}
    assert prep.main(command) == 1  # the lock was released: the same process takes it again
    assert _one_line(capsys).startswith(
        f"error: cannot write {out / 'index.json'}: No space left on device "
        f"[ENOSPC]; {n} of {n} shards are done and kept"
    )
    assert not list(out.glob("*.tmp")) and not (out / "index.json").exists()

    full = set()
    assert prep.main(command) == 0
    np.testing.assert_array_equal(stream(out), reference(texts, "byte"))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("workers", ["0", "2"])
def test_disk_full_in_the_writer_here_or_in_a_worker(corpus, tmp_path, capsys, workers):
    """A real ENOSPC from writing a shard: its .tmp name is a link to /dev/full."""
    root, texts = corpus
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_00003.bin.tmp").symlink_to("/dev/full")
    command = [
        *inputs(root),
        "--out",
        str(out),
        "--workers",
        workers,
        "--no-progress",
        "--unit-mb",
        str(3000 / (1 << 20)),
    ]
    assert prep.main(command) == 1
    n = len(json.loads((out / "plan.json").read_text())["units"])
    err = _one_line(capsys)
    assert re.fullmatch(
        rf"error: cannot write {re.escape(str(out / 'shard_00003.bin'))}: No space left on device "
        rf"\[ENOSPC\]; (\d+) of {n} shards are done and kept in {re.escape(str(out))}: free some "
        "space and rerun the same command to resume",
        err,
    ), err
    assert not list(out.glob("*.tmp")) and not (out / "index.json").exists()
    assert prep.main(command) == 0
    np.testing.assert_array_equal(stream(out), reference(texts, "byte"))


def test_a_second_run_on_the_same_out_is_refused(corpus, tmp_path, capsys):
    root, texts = corpus
    out = tmp_path / "out"
    out.mkdir()
    command = [*inputs(root), "--out", str(out), "--workers", "0", "--no-progress"]
    with OutLock(out):  # another run holds it
        holder = json.loads((out / ".lock").read_text())
        assert prep.main(command) == 1
        assert _one_line(capsys) == (
            f"error: another data.prepare is writing {out} (pid {os.getpid()}, since "
            f"{holder['since']}); wait for it or choose another --out"
        )
        assert not (out / "plan.json").exists()
    assert prep.main(command) == 0
    np.testing.assert_array_equal(stream(out), reference(texts, "byte"))


def _wait_for_shards(out, proc, more_than):
    deadline = time.monotonic() + 60
    while len(list(out.glob("shard_*.json"))) <= more_than:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)


def test_sigterm_and_ctrl_c_stop_cleanly_and_the_rerun_resumes(tmp_path):
    """SIGTERM to the main process, then SIGINT to the whole process group (Ctrl-C), each while two
    workers are tokenising: one line, exit 143/130, finished shards kept, no .tmp; the rerun equals an
    uninterrupted run."""
    with open(tmp_path / "big.jsonl", "w") as f:  # ~32 MB of short documents: ~25 units, a few seconds
        f.writelines(f'{{"text": "document {i} of many"}}\n' for i in range(1_100_000))
    command = [
        sys.executable,
        "-m",
        "boost_jax.data.prepare",
        str(tmp_path / "big.jsonl"),
        "--workers",
        "2",
        "--unit-mb",
        "1",
        "--no-progress",
        "--out",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    whole = subprocess.run([*command, str(tmp_path / "whole")], capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stderr

    out, done = tmp_path / "out", 0
    for sig, status in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        proc = subprocess.Popen(
            [*command, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        _wait_for_shards(out, proc, done)
        (os.kill if sig == signal.SIGTERM else os.killpg)(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == status, err
        m = re.fullmatch(
            rf"error: interrupted \({sig.name}\); (\d+) of (\d+) shards are done and kept: rerun the "
            r"same command to resume",
            err.strip(),
        )
        assert m and "Traceback" not in err, err
        done, total = int(m[1]), int(m[2])
        assert done == len(list(out.glob("shard_*.json"))) and 0 < done < total
        assert not list(out.glob("*.tmp")) and not (out / "index.json").exists()

    again = subprocess.run([*command, str(out)], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr
    index = json.loads((out / "index.json").read_text())
    assert index == json.loads((tmp_path / "whole" / "index.json").read_text()) and len(index["shards"]) == total
    for shard in index["shards"]:
        for name in (shard["file"], shard["ends"]):
            assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name

"""Faults and bad inputs at the edges: imports and exports that never overwrite a run or a model,
verified document indexes and tokenizer files, data with nothing to learn from, full disks and
read-only mounts, killed jobs, preemption during evaluation. Each test injects the fault and checks
the one-line message, the exit status and what is on disk."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import small_config

from boost_jax import train
from boost_jax.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(root: Path) -> dict:
    """{relative path: bytes} of every file under root (what "nothing on disk was lost" compares)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- import and export never overwrite


def hf_model(tmp_path, name="hf", seed=0, tokenizer: bytes | None = None):
    """A HF Llama dir (config.json, model.safetensors, optionally tokenizer.json) of the small model,
    written from a freshly initialised model (no training needed)."""
    pytest.importorskip("safetensors")
    from flax import nnx
    from safetensors.numpy import save_file

    from boost_jax import export
    from boost_jax.model.transformer import build_model

    m = small_config(tmp_path / "unused", **{"model.linear": "dense"}).model
    d = tmp_path / name
    d.mkdir()
    save_file(
        export.to_hf(nnx.to_pure_dict(nnx.state(build_model(m, seed=seed))), m),
        str(d / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (d / "config.json").write_text(json.dumps(export.hf_config(m)))
    if tokenizer is not None:
        (d / "tokenizer.json").write_bytes(tokenizer)
    return d


def test_import_never_writes_into_a_run(tmp_path, capsys):
    """--import-hf into a dir holding a run is refused (the run's steps untouched), the same import
    twice says what exists, and --supersede moves the old steps aside: the newest step is the import's."""
    from boost_jax import export
    from boost_jax.runtime.checkpoints.store import read_run

    first, second = hf_model(tmp_path, "a", seed=1), hf_model(tmp_path, "b", seed=2)
    run = tmp_path / "run"
    assert export.main(["--import-hf", str(first), "--out", str(run)]) == 0
    capsys.readouterr()
    before = tree_bytes(run / "checkpoints")
    for source in (first, second):  # the same import again, and another model
        assert export.main(["--import-hf", str(source), "--out", str(run)]) == 1
        err = one_error_line(capsys.readouterr().err)
        assert f"--out: {run} already holds a run with checkpoints (steps [0])" in err and "--supersede" in err, err
        assert "Fix the cause" not in err
        assert tree_bytes(run / "checkpoints") == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert export.main(["--import-hf", str(first), "--out", str(tmp_path / "other")]) == 1
    assert "already holds files (notes.txt)" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]

    assert export.main(["--import-hf", str(second), "--out", str(run), "--supersede"]) == 0
    out = capsys.readouterr().out
    assert "0.superseded" in out
    moved = tree_bytes(run / "checkpoints" / "0.superseded")
    assert moved == {k[len("0/") :]: v for k, v in before.items() if k.startswith("0/")}  # kept byte for byte
    assert read_run(str(run))[2] == 0
    from safetensors.numpy import load_file

    from boost_jax.runtime.build import load_model

    embed = np.asarray(load_model(str(run))[0].embed[...])
    np.testing.assert_array_equal(embed, load_file(str(second / "model.safetensors"))["model.embed_tokens.weight"])


def test_export_refuses_another_models_files_and_writes_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """A stale tokenizer beside the new model is refused (or moved aside with --supersede); a full disk
    or a read-only mount is one line and leaves the earlier export byte for byte."""
    import safetensors.numpy as stn

    from boost_jax import export

    run = tmp_path / "run"
    assert export.main(["--import-hf", str(hf_model(tmp_path)), "--out", str(run)]) == 0  # byte tokenizer
    hf = tmp_path / "out"
    hf.mkdir()
    (hf / "tokenizer.json").write_text('{"another": "model"}')
    assert export.main(["--checkpoint", str(run), "--out", str(hf)]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert "does not write (tokenizer.json)" in err and "--supersede" in err, err
    assert sorted(p.name for p in hf.iterdir()) == ["tokenizer.json"]
    assert export.main(["--checkpoint", str(run), "--out", str(hf), "--supersede"]) == 0
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json.superseded"]
    assert (hf / "tokenizer.json.superseded").read_text() == '{"another": "model"}'
    before = tree_bytes(hf)

    real = stn.save_file
    for code in (errno.ENOSPC, errno.EROFS):

        def failing(tensors, path, metadata=None, code=code):
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:  # half written when the disk filled up
                f.truncate(os.path.getsize(path) // 2)
            raise OSError(code, os.strerror(code), path)

        monkeypatch.setattr(stn, "save_file", failing)
        assert export.main(["--checkpoint", str(run), "--out", str(hf)]) == 1
        err = one_error_line(capsys.readouterr().err)
        assert f"--out: cannot write {hf}/model.safetensors" in err and errno.errorcode[code] in err, err
        assert "nothing in" in err and tree_bytes(hf) == before


def test_import_on_a_full_disk_is_one_line_and_leaves_no_partial_step(tmp_path, capfd, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    from boost_jax import export

    rename = async_path.rename

    async def disk_full(src, dst):
        if Path(dst).name == "0":
            raise OSError(errno.ENOSPC, "No space left on device")
        return await rename(src, dst)

    monkeypatch.setattr(async_path, "rename", disk_full)
    run = tmp_path / "run"
    assert export.main(["--import-hf", str(hf_model(tmp_path)), "--out", str(run)]) == 1
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: saving step 0 failed") and "No space left" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []  # no 0.orbax-checkpoint-tmp
    monkeypatch.undo()
    assert export.main(["--import-hf", str(hf_model(tmp_path, "again")), "--out", str(run)]) == 0  # rerun works


# ---------------------------------------------------------------- tokenizer files are loaded once, up front


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """(a valid tokenizers JSON, a truncated copy of it, a valid SentencePiece model, a corrupt one)."""
    tokenizers = pytest.importorskip("tokenizers")
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("tok")
    lines = [f"def function_{i}(value):\n    return value * {i}\n" for i in range(300)]
    (d / "corpus.txt").write_text("".join(lines))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "</s>"]))
    tok.save(str(d / "tok.json"))
    text = (d / "tok.json").read_bytes()
    (d / "cut.json").write_bytes(text[: len(text) // 2])  # an interrupted download
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=120, model_type="bpe", minloglevel=2
    )
    raw = bytearray((d / "sp.model").read_bytes())
    (d / "bad.model").write_bytes(bytes(raw[: len(raw) // 3]) + os.urandom(64))
    return d / "tok.json", d / "cut.json", d / "sp.model", d / "bad.model"


@pytest.mark.parametrize("which", [1, 3], ids=["truncated-json", "corrupt-sentencepiece"])
def test_damaged_tokenizer_is_one_line_naming_it(tokenizer_files, make_config, tmp_path, capsys, which):
    from boost_jax.data import build_loaders, prepare

    bad = tokenizer_files[which]
    (tmp_path / "c.txt").write_text("hello world\n" * 50)
    with pytest.raises(ConfigError, match=rf"config field `data\.tokenizer`: {bad} is not a readable"):
        build_loaders(
            make_config(
                **{
                    "data.source": "text",
                    "data.path": str(tmp_path / "c.txt"),
                    "data.tokenizer": str(bad),
                    "model.vocab_size": 512,
                }
            )
        )
    assert (
        prepare.main(
            [
                str(tmp_path / "c.txt"),
                "--out",
                str(tmp_path / "p"),
                "--tokenizer",
                str(bad),
                "--workers",
                "0",
                "--no-progress",
            ]
        )
        == 1
    )
    assert f"--tokenizer: {bad} is not a readable" in one_error_line(capsys.readouterr().err)
    # The intact file of the same kind loads (the check refuses only the damage).
    good = tokenizer_files[which - 1]
    assert (
        prepare.main(
            [
                str(tmp_path / "c.txt"),
                "--out",
                str(tmp_path / "q"),
                "--tokenizer",
                str(good),
                "--workers",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )


def test_json_that_is_not_a_tokenizer_is_called_so(tmp_path, capsys):
    """A valid JSON file that is no tokenizer (a model's config.json, a list) is not called "truncated
    or damaged": the line says what it holds and what data.tokenizer takes."""
    pytest.importorskip("tokenizers")
    from boost_jax.data import prepare
    from boost_jax.data.tokenizer import load_tokenizer

    (tmp_path / "c.txt").write_text("hello world\n" * 5)
    for text, holds in (
        ('{"architectures": ["LlamaForCausalLM"], "vocab_size": 32000}', "the keys architectures, vocab_size"),
        ("[1, 2]", "a JSON list"),
    ):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError) as e:
            load_tokenizer(str(tmp_path / "config.json"))
        assert str(e.value).startswith(
            f"config field `data.tokenizer`: {tmp_path / 'config.json'} is valid JSON but not a tokenizer file ("
        ) and holds in str(e.value), e.value
        assert "truncated" not in str(e.value) and "the tokenizer.json that HF `tokenizers` saves" in str(e.value)
        argv = [str(tmp_path / "c.txt"), "--out", str(tmp_path / "p"), "--tokenizer", str(tmp_path / "config.json")]
        assert prepare.main([*argv, "--workers", "0", "--no-progress"]) == 1
        assert "is valid JSON but not a tokenizer file" in one_error_line(capsys.readouterr().err)


def test_import_checks_the_tokenizer_before_copying_it(tokenizer_files, tmp_path, capsys):
    from boost_jax import export

    hf = hf_model(tmp_path, tokenizer=tokenizer_files[1].read_bytes())
    assert export.main(["--import-hf", str(hf), "--out", str(tmp_path / "run")]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert f"{hf}/tokenizer.json is not a readable tokenizers JSON" in err, err
    assert not (tmp_path / "run").exists()
    # An intact one is copied beside the run; a second import over it (--supersede) keeps the first aside.
    good = hf_model(tmp_path, "good", tokenizer=tokenizer_files[0].read_bytes())
    assert export.main(["--import-hf", str(good), "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == tokenizer_files[0].read_bytes()
    (good / "tokenizer.json").write_bytes(tokenizer_files[0].read_bytes() + b"\n")  # another file, same vocabulary
    assert export.main(["--import-hf", str(good), "--out", str(tmp_path / "run"), "--supersede"]) == 0
    assert (tmp_path / "run" / "tokenizer.json.superseded").read_bytes() == tokenizer_files[0].read_bytes()
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (good / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------- prepared indexes are verified when opened


@pytest.fixture
def prepared(tmp_path):
    """A prepared dir (byte tokenizer, documents of random lengths, two shards) and a config reading it
    with document batching."""
    from boost_jax.data.prepare import prepare

    rng = np.random.default_rng(3)
    for k in range(2):
        with open(tmp_path / f"{k}.jsonl", "w") as f:
            for _ in range(60):
                f.write(json.dumps({"text": "x" * int(rng.integers(5, 40))}) + "\n")
    prepare([str(tmp_path / "0.jsonl"), str(tmp_path / "1.jsonl")], tmp_path / "p", unit_bytes=1500, progress=False)
    cfg = small_config(
        tmp_path / "run",
        **{
            "data.source": "tokens",
            "data.path": str(tmp_path / "p"),
            "data.batching": "document",
            "data.token_dtype": "uint16",
        },
    )
    return tmp_path / "p", cfg


@pytest.mark.parametrize(
    "damage, needle",
    [
        (
            lambda e: e.__setitem__([7, 8], e[[8, 7]]),
            r"entry 8 \(the end of document 8\) is \d+, below the previous end",
        ),
        (
            lambda e: e.__setitem__(3, e[-1] + 10),
            r"entry 3 \(the end of document 3\) is \d+, beyond the shard's \d+ tokens",
        ),
        (lambda e: e.__setitem__(0, -5), r"entry 0 \(the end of document 0\) is -5, negative"),
    ],
    ids=["swapped", "beyond", "negative"],
)
def test_damaged_document_index_names_file_and_entry(prepared, damage, needle):
    from boost_jax.data import build_loaders

    out, cfg = prepared
    build_loaders(cfg)  # intact: loads
    idx = out / "shard_00001.idx"
    ends = np.fromfile(idx, np.int64)
    assert len(ends) > 10 and np.all(np.diff(ends) > 0)
    damage(ends)
    ends.tofile(idx)
    with pytest.raises(ValueError, match=rf"{idx}: " + needle) as e:
        build_loaders(cfg)
    assert f"prepare {out} again" in str(e.value)


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda t: t[: len(t) // 2], r"index\.json is not readable JSON \(.*\); it may be truncated"),
        (
            lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "shards"}),
            r"index\.json lacks the field\(s\) \['shards'\]",
        ),
        (
            lambda t: json.dumps({**json.loads(t), "shards": [{"file": "shard_00000.bin"}]}),
            r"index\.json: shards\[0\] has no valid 'tokens'",
        ),
    ],
    ids=["truncated", "no-shards", "shard-without-tokens"],
)
def test_damaged_index_json_names_the_file(prepared, damage, needle):
    import shutil

    from boost_jax.data import build_loaders

    out, cfg = prepared
    shutil.copytree(out, out.with_name("intact"))
    (out / "index.json").write_text(damage((out / "index.json").read_text()))
    with pytest.raises(ValueError, match=rf"config field `data\.path`: {out}/" + needle):
        build_loaders(cfg)
    cfg.data.path = f"{out.with_name('intact')}:1,{out}:1"  # the mixture check reads it first: same message
    with pytest.raises(ValueError, match=rf"{out}/" + needle):
        build_loaders(cfg)


# ---------------------------------------------------------------- nothing to learn from


@pytest.mark.parametrize("batching", ["document", "packed"])
def test_data_without_targets_is_refused_at_start(tmp_path, batching):
    """Every document one token long (the byte tokenizer adds no EOS): no row holds a target."""
    from boost_jax.data import build_loaders
    from boost_jax.data.prepare import prepare

    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": "abcdefgh"[i % 8]}) + "\n")
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "p", progress=False)
    cfg = small_config(
        tmp_path / "run",
        **{
            "data.source": "tokens",
            "data.path": str(tmp_path / "p"),
            "data.batching": batching,
            "data.token_dtype": "uint16",
        },
    )
    with pytest.raises(
        ValueError,
        match=r"config field `data\.path`: every document of the train data .* is at "
        r"most 1 token\(s\) long, so no row holds a target",
    ):
        build_loaders(cfg)
    with pytest.raises(ValueError, match="no row holds a target"):
        train.run(cfg)
    assert not list((tmp_path / "run").glob("checkpoints/*"))
    cfg.data.batching = "stream"  # the same tokens as one stream: every next token is a target
    assert build_loaders(cfg)[0].batch(0).shape == (8, 17)


def test_a_batch_without_targets_reports_no_loss(make_config, tmp_path):
    """A batch of documents whose rows hold no target sums its loss over nothing: the row written for
    it has no loss (nor perplexity 1); a batch with targets logs its loss."""
    from boost_jax.runtime.report import Reporter

    cfg = make_config()
    rep = Reporter(
        tmp_path,
        name=cfg.name,
        steps=cfg.train.steps,
        tokens_per_step=cfg.train.global_batch * cfg.train.seq_len,
        progress=cfg.train.progress,
        main_process=True,
        flops_per_token=1.0,
    )
    rep.start_bar(0)
    for step, targets in ((1, 0), (2, 5)):
        rep.step_done()
        rep.count_tokens(8)
        rep.log(
            step,
            {
                "loss": np.float32(0.0 if targets == 0 else 2.5),
                "finite": True,
                "targets": targets,
                "tokens": 8,
                "grad_norm": 0.0,
                "lr": 1e-3,
            },
            0,
            {},
        )
    rep.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert "loss" not in rows[0] and "perplexity" not in rows[0]
    assert rows[1]["loss"] == 2.5 and rows[1]["perplexity"] == pytest.approx(np.exp(2.5))


# ---------------------------------------------------------------- full disks under a running trainer


def test_a_failed_save_is_reported_once_and_leaves_no_partial_step(tmp_path):
    """Orbax raises a failed save again at every later wait, and its other writer threads may still
    create files after the error: the one line names the step (never "step None") and no
    N.orbax-checkpoint-tmp is left."""
    from boost_jax.errors import CheckpointError
    from boost_jax.runtime.checkpoints.store import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, async_save=True, owner=True)
    (tmp_path / "checkpoints" / "3").mkdir()  # a finished step
    ckpt.pending = 4
    straggler = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp" / "state"

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")

    calls = []

    def straggling():  # the first wait ends a writer thread that created files after the error
        if not calls:
            straggler.mkdir(parents=True)
        calls.append(1)

    ckpt.manager.check_for_errors = fail
    ckpt.manager.wait_until_finished = straggling
    with pytest.raises(
        CheckpointError,
        match=r"saving step 4 failed: No space left on device \[ENOSPC\] \(OSError: \[Errno 28\] No space left on "
        r"device\); its partial files were removed; the last good checkpoint "
        r"is step 3",
    ):
        ckpt.check()
    ckpt.close()  # the same failure again from Orbax: not a second error ("saving step None")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]


def test_a_write_failing_under_the_run_dir_is_one_line(tmp_path, monkeypatch):
    """metrics.jsonl cannot be written (a full disk): one line naming the last good checkpoint, which
    stays complete and restores."""
    from boost_jax.runtime.metrics import MetricsWriter

    write = MetricsWriter.write

    def full(self, step, record):
        if step >= 6 and "loss" in record:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return write(self, step, record)

    monkeypatch.setattr(MetricsWriter, "write", full)
    cfg = small_config(
        tmp_path / "run", **{"train.steps": 8, "train.eval_every": 0, "checkpoint.every": 4, "train.log_every": 1}
    )
    with pytest.raises(
        train.ERRORS,
        match=rf"cannot write {tmp_path}/run/metrics\.jsonl \(No space left on device "
        rf"\[ENOSPC\]\); the last good checkpoint is step 4 in ",
    ):
        train.run(cfg)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["4"]
    monkeypatch.undo()
    assert train.run(cfg)["step"] == 8  # resumes from step 4


TB_EXIT = """
import errno, sys
from boost_jax.runtime.metrics import MetricsWriter
w = MetricsWriter(sys.argv[1])
w.write(1, {"loss": 1.0})
def full(*a):
    raise OSError(errno.ENOSPC, "No space left on device")
for writer in w._tb.all_writers.values():
    writer.event_writer._ev_writer.flush = full
if sys.argv[2] == "close":
    try:
        w.close()
    except OSError as e:
        print("close failed:", e.strerror)
if sys.argv[2] == "thread":  # the logger thread's own flush fails (its next one is due now)
    import time
    for writer in w._tb.all_writers.values():
        writer.event_writer._worker._next_flush_time = 0
    w.write(2, {"loss": 2.0})
    deadline = time.time() + 60
    while not w._failed and time.time() < deadline:
        time.sleep(0.05)
    w.write(3, {"loss": 3.0})  # says once that the mirroring stopped; metrics.jsonl goes on
    w.close()
"""


@pytest.mark.parametrize("how", ["close", "exit", "thread"])
def test_tensorboard_on_a_full_disk_leaves_no_traceback_at_exit(tmp_path, how):
    """A full disk under TensorBoard's event file: at close, at exit, or in tensorboardX's logger
    thread (its periodic flush, which once printed "Exception in thread" at any moment)."""
    r = subprocess.run(
        [sys.executable, "-c", TB_EXIT, str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    assert ("close failed: No space left on device" in r.stdout) == (how == "close")
    if how == "thread":
        assert r.stderr.count("TensorBoard logging stopped at step ") == 1, r.stderr  # step 2 or 3: the thread's timing
        assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]


# ---------------------------------------------------------------- the TensorBoard dir removed under a run


def test_tensorboard_dir_removed_under_a_run_is_recreated(tmp_path):
    import shutil

    from boost_jax.runtime.metrics import MetricsWriter

    notes = []
    w = MetricsWriter(str(tmp_path), note=notes.append)
    w.write(1, {"loss": 1.0})
    shutil.rmtree(tmp_path / "tensorboard")
    for step in (2, 3):
        w.write(step, {"loss": 2.0})
    assert len(notes) == 1 and "was removed while training; recreated it from step 2" in notes[0], notes
    w.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and sum(p.stat().st_size for p in events) > 0
    # It cannot be recreated (a file is in the way): said once, and metrics.jsonl goes on.
    w = MetricsWriter(str(tmp_path / "b"), note=notes.append)
    shutil.rmtree(tmp_path / "b" / "tensorboard")
    (tmp_path / "b" / "tensorboard").write_text("in the way")
    for step in (1, 2, 3):
        w.write(step, {"loss": 3.0})
    w.close()
    assert len(notes) == 2 and "TensorBoard logging stopped at step 1" in notes[1], notes
    assert [json.loads(line)["step"] for line in open(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3]


# ---------------------------------------------------------------- a token file truncated under a running trainer


@pytest.mark.parametrize("every", [2, 1000], ids=["saved", "nothing-saved"])
def test_token_file_truncated_under_a_trainer_is_one_line(make_config, tmp_path, every):
    """The mapped token file shrinks while the trainer reads it: one line naming it (not "Fatal
    Python error: Bus error": the size check before each batch's read), exit status 1, the save in
    flight finished (no `*-tmp` directory left), the newest checkpoint complete, and the line says
    what a rerun does: resume from that step, or start from the start when nothing was saved."""
    from test_faults import long_config, saved_state, spawn, steps_on_disk, tmp_dirs, wait_for_rows

    tokens = tmp_path / "t.bin"
    (np.random.default_rng(0).integers(0, 256, 400_000).astype(np.uint16)).tofile(tokens)
    cfg = long_config(
        make_config,
        tmp_path / "run",
        **{
            "data.source": "tokens",
            "data.path": str(tokens),
            "data.token_dtype": "uint16",
            "checkpoint.every": every,
            "checkpoint.keep": 100,
        },
    )
    proc = spawn(cfg)
    wait_for_rows(proc, cfg.run_dir, 4)
    os.truncate(tokens, 4096)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    lines = [ln for ln in out.splitlines() if ln.startswith("error:") or "Fatal" in ln or "Traceback" in ln]
    steps = steps_on_disk(cfg.run_dir)
    said = (
        f"error: {tokens}: this memory-mapped token file became shorter while the run read it "
        "(truncated or rewritten on disk); restore it (or prepare it again) and rerun: the run "
    )
    exact = f"resumes from step {max(steps)}, its last complete checkpoint" if steps else "starts from the start"
    assert len(lines) == 1 and lines[0].startswith(said), out
    handler = "resumes from its newest complete checkpoint (from the start if it has none)"
    if lines[0] != said + handler:  # (else a truncation between the check and the read: the SIGBUS
        assert lines[0].startswith(said + exact), out  # handler's line, which cannot know the checkpoints)
        assert tmp_dirs(cfg.run_dir) == []
    if every == 2:
        assert max(steps) >= 2 and saved_state(cfg.run_dir, max(steps), cfg)[1]["step"] == max(steps)
    else:
        assert steps == []


def test_an_unfinished_save_is_removed_and_named_at_start(make_config, tmp_path, capsys):
    """`N.orbax-checkpoint-tmp` left by a run killed mid-save: the next start removes it and says
    what it does instead (resume from the newest complete step, or start from step 0); a complete
    checkpoint is never touched."""
    cfg = make_config(**{"train.steps": 4, "train.eval_every": 0})
    train.run(cfg)  # steps 4 saved
    ckpts = Path(cfg.run_dir) / "checkpoints"
    before = tree_bytes(ckpts / "4")
    (ckpts / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    (ckpts / "6.orbax-checkpoint-tmp" / "state" / "part").write_bytes(b"half")
    cfg.train.steps = 6
    capsys.readouterr()
    assert train.run(cfg)["step"] == 6
    out = capsys.readouterr().out
    assert (
        f"removed the unfinished save of step 6 in {ckpts} (a run stopped mid-save); resuming from step 4, "
        "the newest complete checkpoint" in out
    ), out
    assert tree_bytes(ckpts / "4") == before and not list(ckpts.glob("*tmp*"))
    # Nothing complete: the start says it starts from step 0.
    fresh = make_config(run_dir=tmp_path / "fresh", **{"train.steps": 2, "train.eval_every": 0})
    (Path(fresh.run_dir) / "checkpoints" / "2.orbax-checkpoint-tmp").mkdir(parents=True)
    assert train.run(fresh)["step"] == 2
    assert "no complete checkpoint is left: starting from step 0" in capsys.readouterr().out


# ---------------------------------------------------------------- values that mean nothing


@pytest.mark.parametrize("source", ["jsonl", "text"])
def test_text_sources_pointed_at_a_prepared_dir(prepared, source):
    from boost_jax.data import build_loaders

    out, cfg = prepared
    for path in (out, out / "index.json"):
        cfg.data.source, cfg.data.path, cfg.data.batching = source, str(path), "stream"
        with pytest.raises(
            ValueError,
            match=rf"config field `data\.path`: {path} is a directory of token shards made "
            r"by `python -m boost_jax\.data\.prepare`.*set data\.source=tokens",
        ):
            build_loaders(cfg)


def cluster_file(tmp_path, **changes):
    """configs/clusters/a100_4x.py with some fields' assignments rewritten."""
    import re

    text = (ROOT / "configs" / "clusters" / "a100_4x.py").read_text()
    for k, v in changes.items():
        text, n = re.subn(
            rf"^(\s*c\.{k} = ).*$",
            lambda m: m.group(1) + (f"float('{v}')" if v != v else repr(v)),
            text,
            count=1,
            flags=re.M,
        )
        assert n == 1, k
    path = tmp_path / "cluster.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"usable_hbm_fraction": 1.5}, "usable_hbm_fraction is a fraction, at most 1, got 1.5"),
        ({"gemm_efficiency": 2.0}, "gemm_efficiency is a fraction, at most 1"),
        ({"gpus_per_node": 4.5}, "gpus_per_node must be a whole number, got 4.5"),
        ({"peak_flops": "fast"}, "peak_flops must be a number, got 'fast'"),
        ({"intra_latency": float("nan")}, "intra_latency must be a positive number"),
    ],
    ids=["usable>1", "efficiency>1", "fractional-gpus", "not-a-number", "nan"],
)
def test_cluster_files_with_values_that_mean_nothing(tmp_path, changes, needle):
    from boost_jax.planner import load_cluster

    path = cluster_file(tmp_path, **changes)
    with pytest.raises(ValueError, match=rf"--cluster {path}: " + needle.replace(".", r"\.").replace("(", r"\(")):
        load_cluster(path)
    assert load_cluster(cluster_file(tmp_path)).name  # the file unchanged loads


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--top", "-1"], "--top must be positive"),
        (
            ["--schedule", "circular", "--repeats", "5", "--pipeline", "2"],
            "no plan to price: no layout of 24 layers on 16 GPUs meets --pipeline 2, --schedule circular, --repeats 5",
        ),
    ],
    ids=["top", "repeats"],
)
def test_plan_arguments_that_leave_nothing(args, needle):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_jax.plan",
            "--config",
            "configs/cola_1b.py",
            "--devices",
            "16",
            "--cluster",
            "configs/clusters/a100_4x.py",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("plan: searching"))  # progress
    assert r.returncode == 1 and "Traceback" not in err and needle in err, r.stderr
    assert err.strip().count("\n") == 0, r.stderr


def test_generate_values_that_mean_nothing(tmp_path, capsys):
    from boost_jax import export, generate

    run = tmp_path / "run"
    assert export.main(["--import-hf", str(hf_model(tmp_path)), "--out", str(run)]) == 0  # max_seq_len 32
    capsys.readouterr()
    for t in ("nan", "inf"):
        with pytest.raises(SystemExit) as e:
            generate.main(["--checkpoint", str(run), "--temperature", t])
        assert e.value.code == 2 and "--temperature" in capsys.readouterr().err
    # Past the context: bounded by it, and said (the KV cache never outgrows the model's context).
    assert (
        generate.main(
            ["--checkpoint", str(run), "--prompt", "abc", "--max_new_tokens", "10000000", "--temperature", "0"]
        )
        == 0
    )
    out = capsys.readouterr()
    assert (
        "note: --max_new_tokens 10000000 runs past the model's context (model.max_seq_len=32, prompt 3 "
        "tokens): generating 29"
    ) in out.err
    assert len(out.out.rstrip("\n").encode("utf-8", errors="surrogateescape")) <= 32 * 3  # 32 tokens at most
    assert generate.main(["--checkpoint", str(run), "--prompt", "x" * 40]) == 1
    assert "--prompt: its 40 tokens fill the model's context" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------- jobs killed halfway


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_prepare_killed_with_sigkill_takes_its_workers_along(tmp_path):
    """kill -9 of data.prepare's main process: its workers exit with it, and the rerun resumes to the
    shards of an uninterrupted run."""
    from boost_jax.data import prepare as prep

    with open(tmp_path / "big.jsonl", "w") as f:  # ~25 MB of short documents: two units of seconds each
        f.writelines(f'{{"text": "document {i} of many"}}\n' for i in range(900_000))
    command = [
        sys.executable,
        "-m",
        "boost_jax.data.prepare",
        str(tmp_path / "big.jsonl"),
        "--workers",
        "2",
        "--unit-mb",
        "12",
        "--no-progress",
        "--out",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "log", "w")  # a file, not a pipe: no wait for the workers' end of it
    proc = subprocess.Popen([*command, str(tmp_path / "out")], stdout=log, stderr=log, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "out").glob("shard_*.bin.tmp"))) < 2:  # both workers mid-unit
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.01)
    workers = [k for k in _children(proc.pid) if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    log.close()
    time.sleep(0.3)  # far less than a unit takes: workers left to finish theirs would still be alive
    assert not any(_alive(k) for k in workers)
    assert (
        prep.main(
            [
                str(tmp_path / "big.jsonl"),
                "--workers",
                "0",
                "--unit-mb",
                "12",
                "--no-progress",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    assert (
        prep.main(
            [
                str(tmp_path / "big.jsonl"),
                "--workers",
                "0",
                "--unit-mb",
                "12",
                "--no-progress",
                "--out",
                str(tmp_path / "whole"),
            ]
        )
        == 0
    )
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index == json.loads((tmp_path / "whole" / "index.json").read_text())
    for shard in index["shards"]:
        assert (tmp_path / "out" / shard["file"]).read_bytes() == (tmp_path / "whole" / shard["file"]).read_bytes()


def test_a_rerun_waits_for_workers_of_an_earlier_run(tmp_path, capsys):
    """A worker of an earlier run still alive (holding its shared lock): the rerun says so and waits."""
    import fcntl
    import threading

    from boost_jax.data.shard_dir import WORKERS_LOCK, wait_for_workers

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / WORKERS_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)
    released = []

    def release():
        time.sleep(0.5)
        released.append(time.monotonic())
        os.close(fd)

    threading.Thread(target=release).start()
    wait_for_workers(out)
    assert released and time.monotonic() >= released[0]
    assert "waiting for the workers of an earlier data.prepare" in capsys.readouterr().err


def test_evaluate_retries_on_the_newest_step_when_rotation_removes_its_step(tmp_path, monkeypatch):
    """evaluate and load_model read the newest step of a run dir; a trainer with keep=1 removes it
    (a new step saved) between the listing and the read: the newest step is read, not "unreadable";
    a step given by name, or one damaged in place, is still an error."""
    import shutil

    from boost_jax import evaluate as ev
    from boost_jax.errors import CorruptCheckpoint
    from boost_jax.runtime.build import load_model
    from boost_jax.runtime.checkpoints import store as ck

    cfg = small_config(
        tmp_path / "run", **{"train.steps": 4, "train.eval_every": 0, "checkpoint.every": 2, "checkpoint.keep": 1}
    )
    train.run(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["4"]
    want = ev.evaluate(str(tmp_path / "run"), batches=1)
    real = ck.read_run
    moves = []

    def racing(checkpoint):  # the trainer saves step N+2 and rotates N away right after the listing
        got = real(checkpoint)
        if not moves:
            n = max(int(p.name) for p in root.iterdir())
            shutil.copytree(root / str(n), root / str(n + 2))
            shutil.rmtree(root / str(n))
            moves.append(1)
        return got

    monkeypatch.setattr(ck, "read_run", racing)
    got = ev.evaluate(str(tmp_path / "run"), batches=1)
    assert got["step"] == 6 and got["loss"] == want["loss"]
    moves.clear()
    model, _, _ = load_model(str(tmp_path / "run"))  # generate's and export's loader: 6 -> 8
    assert model is not None and sorted(p.name for p in root.iterdir()) == ["8"]
    moves.clear()
    with pytest.raises(CorruptCheckpoint):  # a step named by the user: no silent substitute
        ev.evaluate(str(root / "8"), batches=1)


# ---------------------------------------------------------------- preemption during a long evaluation


def test_sigterm_during_a_long_first_eval_stops_between_batches(make_config, tmp_path):
    """SIGTERM while the start-up evaluation runs (over 20000 batches of the 3.6M-token held-out split:
    far longer than the test waits): it stops between batches, the next step saves, exit 0."""
    from test_faults import cli_flags, long_config, saved_state, steps_on_disk

    cfg = long_config(
        make_config,
        tmp_path / "run",
        **{
            "train.eval_every": 4,
            "train.eval_batches": 100000,
            "checkpoint.every": 100000,
            "data.eval_fraction": 0.9,
            "data.embedded_max_bytes": 4_000_000,
        },
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "boost_jax.train", *cli_flags(cfg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("compiling the train and eval steps"):
            break
    time.sleep(3)  # well into the evaluation
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out
    assert "the evaluation at step 0 was stopped between batches" in out and "stopped by SIGTERM at step 1" in out, out
    assert steps_on_disk(cfg.run_dir) == [1] and saved_state(cfg.run_dir, 1, cfg)[1]["step"] == 1
    assert time.monotonic() - start < 200


def test_a_stop_during_an_eval_in_the_loop_saves_that_step(make_config, monkeypatch):
    """A stop signal arriving while the step-4 evaluation runs: no more eval batches are run, step 4 is
    saved, the run stops there, and no eval loss is reported for it."""
    from boost_jax.runtime.evaluation import eval_loss
    from boost_jax.runtime.signals import StopFlag

    cfg = make_config(
        **{
            "train.steps": 8,
            "train.eval_every": 4,
            "train.eval_batches": 50,
            "train.log_every": 1,
            "checkpoint.every": 100,
        }
    )
    flag = StopFlag()
    asked = []

    def evaluating(built, data, params, stop=None, **kw):
        def stop_after_three():  # the signal comes during batch 1 of the second evaluation
            asked.append(1)
            if len(evals) == 2 and len(asked) == 3:
                flag.signal = "SIGTERM"
            return stop()

        evals.append(1)
        asked.clear()
        return eval_loss(built, data, params, stop=stop_after_three, **kw)

    evals = []
    monkeypatch.setattr(train, "eval_loss", evaluating)
    out = train.run(cfg, stop=flag)
    assert out["stopped_by"] == "SIGTERM" and out["step"] == 4 and out["last_checkpoint_step"] == 4
    assert len(asked) == 3  # asked before batches 0, 1 and 2, which saw the signal: 2 and later never ran
    assert [s for s, _ in out["evals"]] == [0]  # the interrupted evaluation is not reported
    assert sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()) == ["4"]


def test_a_final_evaluation_cut_off_is_run_by_the_rerun(make_config, monkeypatch, capsys):
    """A stop signal during the final evaluation: the last step is saved and says that its evaluation
    did not finish; rerunning the finished run runs that evaluation (and says so), with the loss
    `evaluate` measures on that step; a rerun after that has nothing left to do."""
    from tests_support import metric_rows

    from boost_jax import evaluate as ev
    from boost_jax.runtime.evaluation import eval_loss
    from boost_jax.runtime.signals import StopFlag

    cfg = make_config(**{"train.steps": 4, "train.eval_every": 4, "train.eval_batches": 3, "checkpoint.every": 100})
    flag = StopFlag()
    evals = []

    def evaluating(built, data, params, stop=None, **kw):
        evals.append(1)

        def signal_in_the_last():  # the signal comes during the final (second) evaluation
            if len(evals) == 2:
                flag.signal = "SIGTERM"
            return stop()

        return eval_loss(built, data, params, stop=signal_in_the_last, **kw)

    monkeypatch.setattr(train, "eval_loss", evaluating)
    out = train.run(cfg, stop=flag)
    assert out["step"] == 4 and out["stopped_by"] == "SIGTERM" and [s for s, _ in out["evals"]] == [0]
    assert "the evaluation at step 4 was stopped between batches" in capsys.readouterr().out
    monkeypatch.undo()
    again = train.run(cfg)
    printed = capsys.readouterr().out
    assert (
        "the final evaluation (step 4) was stopped before it finished when the run ended; running it now" in printed
    ), printed
    want = ev.evaluate(cfg.run_dir)["loss"]
    assert [s for s, _ in again["evals"]] == [4] and again["evals"][0][1] == pytest.approx(want, rel=1e-6)
    assert metric_rows(cfg.run_dir, "eval_loss")[4] == pytest.approx(want, rel=1e-6)
    third = train.run(cfg)
    assert third["evals"] == [] and "final evaluation" not in capsys.readouterr().out


# ---------------------------------------------------------------- one input under two spellings


def test_one_input_under_two_spellings_is_refused(prepared, tmp_path, monkeypatch, capsys):
    from boost_jax.data import prepare as prep
    from boost_jax.data.sources import parse_mixture

    out, _ = prepared
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    assert prep.main(["c.jsonl", "./c.jsonl", "--out", "o", "--workers", "0", "--no-progress"]) == 1
    assert "inputs: ./c.jsonl is named twice (as c.jsonl and ./c.jsonl)" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()
    for spec in ("c.jsonl:1,./c.jsonl:2", f"{out}:1,{out}/index.json:1", f"{out}:1,{out}/../p/:1"):
        with pytest.raises(ValueError, match=r"config field `data\.path`: .* names a source twice \(.* are the same\)"):
            parse_mixture(spec, "data.path")
    assert len(parse_mixture(f"{out}:1,c.jsonl:1", "data.path")) == 2  # two sources stay two


def test_circular_schedule_needs_stages_and_one_device_tools_read_such_runs(make_config):
    """parallel.pipeline_schedule=circular with parallel.pipeline=1 is refused like remat.pipeline=stage;
    a run trained with both (on 2 stages) is still read onto one device by generate/export/evaluate."""
    import jax

    from boost_jax import evaluate as ev
    from boost_jax.runtime.build import load_model
    from boost_jax.validate import validate

    with pytest.raises(
        ConfigError,
        match=r"config field `parallel\.pipeline_schedule`: circular interleaves layer "
        r"chunks over pipeline stages, but parallel\.pipeline=1",
    ):
        validate(make_config(**{"parallel.pipeline_schedule": "circular"}))
    cfg = make_config(
        **{
            "parallel.pipeline": 2,
            "parallel.data": 2,
            "parallel.tensor": 2,
            "model.n_layers": 4,
            "train.steps": 2,
            "parallel.pipeline_schedule": "circular",
            "parallel.pipeline_repeats": 2,
            "remat.pipeline": "stage",
            "train.eval_every": 0,
            "checkpoint.every": 2,
        }
    )
    train.run(cfg)
    model, loaded, _ = load_model(cfg.run_dir)
    assert loaded.parallel.pipeline == 1 and loaded.parallel.pipeline_schedule == "gpipe"
    one = ev.evaluate(cfg.run_dir, batches=1, devices=jax.devices()[:1])
    both = ev.evaluate(cfg.run_dir, batches=1)  # on the run's own 2-stage circular mesh
    assert one["mesh"]["pipeline"] == 1 and both["mesh"]["pipeline"] == 2
    assert one["loss"] == pytest.approx(both["loss"], rel=1e-5)


def test_an_evaluation_without_targets_reports_no_loss():
    """Eval batches of documents with no target (one token each) sum their loss over nothing: the
    result is NaN (no loss), not 0 (perplexity 1); with targets it is their mean."""
    import types

    import jax

    from boost_jax.data import DocumentLoader
    from boost_jax.runtime.evaluation import eval_loss

    for length, per_target in ((1, None), (5, 2.0)):
        docs = np.arange(64 * length, dtype=np.uint16) % 200
        data = DocumentLoader(
            [docs],
            [np.arange(1, 65) * length],
            seq_len=8,
            name="t",
            global_batch=8,
            seed=0,
            vocab_size=256,
            shuffle=False,
        )

        def eval_step(params, batch):  # each target costs per_target (none here when length is 1)
            targets = np.maximum(np.asarray(batch["lengths"]) - 1, 0)
            return (
                np.array([float(targets.sum()) * (per_target or 0.0)]),
                np.array([targets.sum()]),
                np.array([np.asarray(batch["lengths"]).sum()]),
            )

        cfg = types.SimpleNamespace(
            train=types.SimpleNamespace(
                global_batch=8, seq_len=8, eval_batches=2, eval_tokens=0, eval_microbatches=1, grad_accum=1
            )
        )
        built = types.SimpleNamespace(
            cfg=cfg, eval_step=eval_step, eval_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
        got = eval_loss(built, data, None)
        if per_target is None:
            assert np.isnan(got["loss"]) and np.isnan(got["cola_loss"]) and got["targets"] == 0, got
        else:
            assert got["loss"] == pytest.approx(per_target)


def test_evaluate_says_when_there_is_nothing_to_measure(tmp_path, capsys, monkeypatch):
    from boost_jax import evaluate, export

    run = tmp_path / "run"
    assert export.main(["--import-hf", str(hf_model(tmp_path)), "--out", str(run)]) == 0
    monkeypatch.setattr(
        evaluate,
        "eval_loss",
        lambda *a, **k: {
            "loss": float("nan"),
            "batches": 2,
            "tokens": 16,
            "targets": 0,
            "cola_loss": float("nan"),
            "cola_denominator": 3,
            "cola_batch_rows": 8,
        },
    )
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the 2 evaluated batches hold no target") and "weights" not in err, err


def test_a_sigbus_elsewhere_keeps_its_usual_handling(tmp_path):
    """The handler speaks only for the watched token files: another SIGBUS reaches the handler from
    before (faulthandler here) and ends the process as it would have."""
    script = (
        "import os, signal, numpy as np\nfrom boost_jax.data.mapped import watch\n"
        "watch(np.zeros(10, np.uint8), 'x')\nos.kill(os.getpid(), signal.SIGBUS)\nprint('survived')\n"
    )
    r = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == -signal.SIGBUS and "Fatal Python error: Bus error" in r.stderr, r
    assert "survived" not in r.stdout and "token file" not in r.stderr


SIGBUS_READ = """
import os, sys
import numpy as np
from boost_jax.data.sources import token_files
path = sys.argv[1]
(np.arange(400_000) % 256).astype(np.uint16).tofile(path)
tokens = token_files([path], "uint16")[0]
print(int(tokens[300_000]), flush=True)
os.truncate(path, 4096)
print(int(tokens[300_000]))
"""


def test_a_read_past_a_truncated_token_file_is_one_line(tmp_path):
    """The SIGBUS of reading a mapped page that the file no longer has: one line naming the file."""
    r = subprocess.run(
        [sys.executable, "-c", SIGBUS_READ, str(tmp_path / "t.bin")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 1 and r.stdout.split() == [str(300_000 % 256)], r
    assert r.stderr == (
        f"error: {tmp_path / 't.bin'}: this memory-mapped token file became shorter while the run "
        "read it (truncated or rewritten on disk); restore it (or prepare it again) and rerun: the "
        "run resumes from its newest complete checkpoint (from the start if it has none)\n"
    ), r.stderr


def test_size_check_of_the_mapped_files(tmp_path):
    from boost_jax.data import mapped
    from boost_jax.data.sources import token_files

    before = mapped.mark()
    for name in ("a.bin", "b.bin"):
        np.zeros(1000, np.uint16).tofile(tmp_path / name)
    token_files([str(tmp_path / "a.bin"), str(tmp_path / "b.bin")], "uint16")
    files = mapped.mapped_since(before)
    assert files == {str(tmp_path / "a.bin"): 2000, str(tmp_path / "b.bin"): 2000}
    mapped.check_sizes(files)  # intact
    os.truncate(tmp_path / "b.bin", 100)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'b.bin'}: this memory-mapped token file became shorter"):
        mapped.check_sizes(files)
    os.remove(tmp_path / "b.bin")  # removed (the mapping keeps its pages): reads go on, no error
    mapped.check_sizes(files)

"""Real full disks: a small tmpfs mounted under the test's directory (root on Linux, as CI runs; skipped
where mounting is not allowed), filled by the writes themselves or by a filler file mid-run. Every
failure ends in one line, with no traceback after it (tensorstore's writer threads completing the
futures of a failed save once printed "RuntimeError: Event loop is closed" tracebacks) and no
`*.orbax-checkpoint-tmp` or `*.tmp` left behind; the files that were there stay as they were."""

import asyncio
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import small_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def disk(tmp_path):
    """mount(size) -> a directory on a new tmpfs of that size (e.g. "64k"), unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): run as root to test real full disks")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(where: Path) -> None:
    """Take every byte left on the file system under `where`."""
    fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def error_lines(stderr: str) -> list[str]:
    """stderr's lines, less Orbax's warning that saving every 2 steps waits for the previous save."""
    return [ln for ln in stderr.splitlines() if ln.strip() and "Waiting for previous save to complete" not in ln]


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "tmp" in p.name)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A trained small dense run (export writes a HF Llama of it) and its HF export."""
    pytest.importorskip("safetensors")
    from boost_jax import export, train

    tmp = tmp_path_factory.mktemp("small")
    cfg = small_config(tmp / "run", **{"model.linear": "dense", "train.steps": 2, "train.eval_every": 0})
    train.run(cfg)
    export.export(str(tmp / "run"), str(tmp / "hf"))
    return tmp / "run", tmp / "hf"


def test_export_on_a_full_disk_is_one_line_and_writes_nothing(small_run, disk, capfd):
    from boost_jax import export

    run, hf = small_run
    full = disk("16k")  # the model's safetensors is larger: safetensors' own writer hits ENOSPC
    assert (hf / "model.safetensors").stat().st_size > 32 * 1024
    assert export.main(["--checkpoint", str(run), "--out", str(full / "out")]) == 1
    (line,) = error_lines(capfd.readouterr().err)
    assert line == (
        f"error: --out: cannot write {full}/out/model.safetensors.tmp (No space left on device "
        f"[ENOSPC]); nothing in {full}/out was changed: free some space or choose a writable --out"
    ), line
    assert list((full / "out").iterdir()) == []


def test_exported_files_are_readable_like_any_new_file(small_run):
    umask = os.umask(0)
    os.umask(umask)
    _, hf = small_run
    modes = {p.name: p.stat().st_mode & 0o777 for p in hf.iterdir()}
    assert modes == {"config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}, modes


def test_import_on_a_full_disk_is_one_line_and_leaves_nothing_partial(small_run, disk):
    """In a process of its own, as a user runs it: what the interpreter prints at exit counts too."""
    _, hf = small_run
    full = disk("64k")
    r = subprocess.run(
        [sys.executable, "-m", "boost_jax.export", "--import-hf", str(hf), "--out", str(full / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert (
        r.returncode == 1
        and line.startswith("error: saving step 0 failed: No space left on device [ENOSPC] (")
        and "its partial files were removed" in line
    ), r.stderr
    assert leftovers(full) == [], leftovers(full)


def test_the_trainer_on_a_disk_that_fills_mid_run(disk):
    """The probe's F06: a trainer writing its run to a disk that another process fills after the
    step-2 checkpoint. One line; no partial step on disk; after space is freed, a rerun resumes from the
    last good checkpoint, which restores."""
    full = disk("16m")
    cfg = small_config(
        full / "run",
        **{
            "train.steps": 10_000,
            "checkpoint.every": 2,
            "checkpoint.async_save": True,
            "train.eval_every": 0,
            "train.log_every": 2,
        },
    )
    from test_faults import cli_flags

    proc = subprocess.Popen(
        [sys.executable, "-m", "boost_jax.train", *cli_flags(cfg)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not (full / "run" / "checkpoints" / "2").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    fill(full)
    out, err = proc.communicate(timeout=300)
    lines = error_lines(err)
    assert len(lines) == 1, err
    line = lines[0]
    assert proc.returncode == 1 and line.startswith("error: ") and "No space left on device" in line, err
    assert "last good checkpoint is step " in line and "Traceback" not in err, err
    assert leftovers(full / "run") == [], leftovers(full / "run")
    saved = sorted(int(p.name) for p in (full / "run" / "checkpoints").iterdir())
    assert saved and saved[-1] >= 2
    (full / "filler").unlink()
    cfg.train.steps = saved[-1] + 2
    from boost_jax import train

    assert train.run(cfg)["step"] == saved[-1] + 2  # resumed: the last good step restores


def test_closed_event_loops_are_not_printed_but_other_unraisables_are(capsys):
    """The hook a checkpointer that owns its run installs: "Event loop is closed" from asyncio's
    call_soon_threadsafe (a writer thread completing a failed save's future) is dropped; anything
    else still reaches the previous hook (here Python's own, which prints it)."""
    from boost_jax.runtime.checkpoints.failures import quiet_orbax_errors

    loop = asyncio.new_event_loop()
    loop.close()

    class Raises:  # an exception nothing can catch: raised in __del__
        def __init__(self, fail):
            self.fail = fail

        def __del__(self):
            self.fail()

    before = sys.unraisablehook
    sys.unraisablehook = sys.__unraisablehook__  # (pytest's own hook turns them into warnings)
    try:
        quiet_orbax_errors()
        Raises(lambda: loop.call_soon_threadsafe(print))
        assert capsys.readouterr().err == ""
        Raises(lambda: json.loads("{"))
        assert "JSONDecodeError" in capsys.readouterr().err
    finally:
        sys.unraisablehook = before

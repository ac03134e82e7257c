"""Every error the project raises on purpose: one line naming the field, file or flag and the fix.

The entry points catch these (and only these, plus FileNotFoundError/ValueError from the standard
library) and print `error: ...` with exit status 1 instead of a traceback. This module is the
ground floor: it imports nothing of ours, and every layer may import it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the fix. Several found
    at once (`problems`, boost_jax/config/checks.py every_problem) are one line each."""

    def __init__(self, message: str = "", problems=None):
        self.problems = list(problems) if problems else [message]
        super().__init__("\n".join(self.problems) if problems else message)


def error_lines(e: Exception) -> str:
    """What an entry point prints for an error it reports: `error: ` and its message, or one such
    line per problem of a ConfigError listing several."""
    return "\n".join(f"error: {p}" for p in getattr(e, "problems", None) or [str(e)])


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here (missing, not fitting the model, a failed save)."""


class CorruptCheckpoint(CheckpointError):
    """A step that cannot be read back as it was saved (unreadable, bad checksum, non-finite)."""


class RunDirBusy(RuntimeError):
    """Another trainer holds the run directory's lock."""


class DistributedError(RuntimeError):
    """Multi-process start-up failed (coordinator, process counts, ids)."""


class TrainingDiverged(RuntimeError):
    """A non-finite step under train.nonfinite=stop (or too many skipped in a row)."""


class PrepareError(ValueError):
    """Bad input or output for the preparation; the message names the file and the fix."""


class ExportError(ValueError):
    """A model that cannot be exported or imported as asked."""


def install_hint(extra: str, package_dir=None) -> str:
    """The command that installs the optional dependencies of `extra`, for the way boost_jax was
    installed: from a checkout (installed editable, or run in place) `pip install -e 'CHECKOUT[extra]'`
    (its absolute path: the hint works from any directory); from a wheel, the extra's own requirements as
    the installed package's metadata lists them (`pip install 'safetensors>=0.4'`), since a path to
    the sources is not there. `package_dir`: the boost_jax package directory (default: this one's)."""
    import importlib.metadata
    import re
    from pathlib import Path

    package = Path(package_dir or Path(__file__).parent).resolve()
    root = package.parent
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '{root}[{extra}]'"
    try:
        requires = importlib.metadata.requires("boost_jax") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    wanted = [
        r.split(";")[0].strip() for r in requires if re.search(rf"""extra\s*==\s*['"]{re.escape(extra)}['"]""", r)
    ]
    return "pip install " + " ".join(f"'{r}'" for r in wanted) if wanted else f"pip install 'boost_jax[{extra}]'"

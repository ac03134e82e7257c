"""Config files: the packaged configs and `get_config()` of a file, every failure one line naming the
file and its line."""

from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path

import ml_collections

from boost_jax.errors import ConfigError

# The configs shipped in the package (boost_jax/configs; in a checkout a link to configs/).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def packaged_configs() -> list[str]:
    """The names `--config NAME` finds among the packaged configs (clusters as clusters/NAME)."""
    return sorted(
        str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.glob("**/*.py") if p.name != "__init__.py"
    )


def config_path(spec) -> str:
    """The file a `--config` value names: the path itself when it is a file, else the packaged config
    of that name (`cola_60m`, `cola_60m.py`, `clusters/a100_4x`, or `configs/cola_60m.py` outside a
    checkout); the value unchanged when neither exists (the caller's error names it)."""
    spec = str(spec)
    if not spec or Path(spec).is_file():
        return spec
    name = spec.removeprefix("./").removeprefix("configs/")
    name = name if name.endswith(".py") else name + ".py"
    packaged = CONFIG_DIR / name
    return str(packaged) if "/.." not in f"/{name}" and packaged.is_file() else spec


def load_config_file(path, flag: str = "--config", *, run_config: bool = False):
    """The `get_config()` of a Python config file (configs/*.py, configs/clusters/*.py) or of a
    packaged config named as `config_path` takes it. Every way the file can fail (missing, a syntax
    error, an exception while it runs, no get_config, a run config that is not a ConfigDict) is a
    ConfigError naming `flag`, the file and its line."""
    path = Path(config_path(path))
    if not path.is_file():
        raise FileNotFoundError(
            f"{flag}: no such file {str(path)!r}; give a config file or a packaged "
            f"config's name ({', '.join(packaged_configs())})"
        )
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(
                f"{flag}: {path} has no get_config(); a config file defines `def get_config():` "
                "returning a ConfigDict (see configs/tiny.py)"
            )
        cfg = module.get_config()
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(f"{flag}: {e.filename or path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - whatever the file's own code raises, reported as one line
        frames = [
            f
            for f in traceback.extract_tb(e.__traceback__)
            if Path(f.filename) == path.resolve() or f.filename == str(path)
        ]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise ConfigError(f"{flag}: {where}: {type(e).__name__}: {e}") from None
    if run_config and not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(
            f"{flag}: {path}: get_config() returned a {type(cfg).__name__}, not an "
            "ml_collections.ConfigDict; start from boost_jax.config.base_config() (see configs/tiny.py)"
        )
    return cfg

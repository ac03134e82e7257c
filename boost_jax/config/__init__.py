"""Run configuration: the schema (defaults, schema.py), named-size presets (presets.py), the checks of plain
values (checks.py) and config files (files.py).

Every run is one `ml_collections.ConfigDict`. `base_config()` holds every key the code reads (so a
typo in `--config.key=value` fails at parse time), `configs/*.py` only change values, and
`check_fields()` rejects impossible numbers and shapes, naming the field and the fix. This module is
the ground floor (it imports nothing of ours but the errors): the names that registries own
(linear kinds, attention implementations, strategies, data sources, kernels, remat policies) and
what a mesh must divide are checked by `boost_jax/validate.py`, which asks each registry.
"""

from __future__ import annotations

from boost_jax.config.checks import (  # noqa: F401
    check,
    check_fields,
    every_problem,
    part,
    profile_range,
)
from boost_jax.config.files import CONFIG_DIR, config_path, load_config_file, packaged_configs  # noqa: F401
from boost_jax.config.presets import (  # noqa: F401
    COLA_OFFICIAL,
    COLA_RECIPE,
    SIZES,
    SLTRAIN_RECIPE,
    TT_SIZES,
    sized_config,
    sltrain_config,
    tt_config,
)
from boost_jax.config.schema import *  # noqa: F401,F403
from boost_jax.errors import ConfigError  # noqa: F401 - config.ConfigError stays importable

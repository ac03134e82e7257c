"""Print the XLA GPU flags the trainer adds (`boost_jax/runtime/xla_gpu_flags.py`):

    python -m boost_jax.xla_gpu_flags              # XLA_FLAGS with them merged in (your values win)
    python -m boost_jax.xla_gpu_flags --explain    # each flag and why, and the ones worth an A/B run
"""
from __future__ import annotations

import os
import sys

from boost_jax.runtime.xla_gpu_flags import FLAGS, MEASURE, merged


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--explain"]:
        for flag, why in FLAGS:
            print(f"{flag:60s} {why}")
        for flag, why in MEASURE:
            print(f"{flag:60s} (not applied) {why}")
        return 0
    if argv:
        print("usage: python -m boost_jax.xla_gpu_flags [--explain]", file=sys.stderr)
        return 2
    print(merged(os.environ.get("XLA_FLAGS", ""))[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

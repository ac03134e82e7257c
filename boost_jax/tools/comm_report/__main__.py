"""`python -m boost_jax.tools.comm_report --config CONFIG --mesh SIZES [--strategy NAMES]`."""

import sys

from boost_jax.tools.comm_report.command import main

main(sys.argv[1:])

"""`python -m boost_jax.tools.step_profile --hlo PROGRAM.hlo[.gz] [--events EVENTS.json]`."""

from boost_jax.tools.step_profile.command import main

main()

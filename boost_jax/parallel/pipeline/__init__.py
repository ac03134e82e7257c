"""Pipeline parallelism over the `pipeline` mesh axis. stack.py `Pipeline` is the one entry for
every schedule; gspmd.py (gpipe, circular) and one_f_one_b.py (1F1B) the schedules; layout.py the
stage layouts and weight copies; arithmetic.py the tick counts, without JAX (the planner reads it).
This file imports nothing, so arithmetic.py loads without JAX."""

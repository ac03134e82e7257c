"""The command-line tools, one folder or module per tool, and what several of them share.

- comm_report/: per-device collectives of each tensor-parallel strategy (`python -m ...comm_report`);
- step_profile/: the step-time table of a compiled GPU program (`python -m ...step_profile`);
- aot.py: the deviceless GPU compile (`python -m ...aot`; `--profile` adds the step-time table);
- shardings.py: each parameter's sharding; plot.py: a run's curves to PNG;
- shared: hlo_comm.py (the HLO parser and its collectives), devices.py (emulated devices, configs,
  --mesh), progress.py (progress lines), targets/ (GPU target configs; the step-time constants).
"""

"""A run's directory on disk: its checkpoints (store.py: save, keep-last-K, restore, integrity), the
one-line errors of failed writes and reads (failures.py), and the run lock that keeps a second
trainer out of a run directory (runlock.py)."""

"""Helpers shared by tests."""
import json
from pathlib import Path


def metric_rows(run_dir, key="loss"):
    """{step: value} of one metric from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return {r["step"]: r[key] for r in rows if key in r}

"""The project source a kernel came from: the stack-frame tables XLA prints ahead of an HLO module
that kept its source locations (tools/step_profile/ categorizes kernels by them)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int
    parent: int  # the caller's frame id (0: none)


def stack_frames(hlo_text: str) -> dict[int, Frame]:
    """{stack_frame_id: Frame} from the module's FileNames / FunctionNames / FileLocations / StackFrames
    tables (XLA prints them after the header when the program kept its source locations). The printed
    parent_frame_id is one more than the caller's id (1: no caller)."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
            continue
        if current is None:
            continue
        m = re.match(r"(\d+) (.*)$", line)
        if m is None:
            if line.strip() == "" or not line[0].isdigit():
                current = None
            continue
        current[int(m.group(1))] = m.group(2)
        if line.startswith("ENTRY") or line.startswith("%"):
            break
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        locations[k] = (
            files.get(int(f.group(1)), "") if f else "",
            functions.get(int(fn.group(1)), "") if fn else "",
            int(ln.group(1)) if ln else 0,
        )
    frames = {}
    for k, v in sections.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        file, function, line = locations.get(int(loc.group(1)), ("", "", 0)) if loc else ("", "", 0)
        frames[k] = Frame(file, function, line, max(int(parent.group(1)) - 1, 0) if parent else 0)
    return frames


def short_path(path: str) -> str:
    """A source path from the package down (`boost_jax/model/loss.py`), else its last two parts."""
    i = path.rfind("boost_jax/")
    return path[i:] if i >= 0 else "/".join(path.split("/")[-2:])

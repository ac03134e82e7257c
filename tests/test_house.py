"""The house's shape: no module of boost_jax/ over 600 lines, no function over 100, and every project
import inside a function says why it is not at the top (a trailing `# lazy: reason` comment: JAX must
not load yet, an optional extra, a cycle the layers forbid)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def problems(path: Path, text: str) -> list[str]:
    lines = text.splitlines()
    found = []
    if len(lines) > MAX_MODULE_LINES:
        found.append(f"{path}: {len(lines)} lines (at most {MAX_MODULE_LINES}: split it by concern)")
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            found.append(f"{path}:{node.lineno} {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom):
                project = inner.level > 0 or (inner.module or "").startswith("boost_jax")
            elif isinstance(inner, ast.Import):
                project = any(a.name.startswith("boost_jax") for a in inner.names)
            else:
                continue
            said = "# lazy:" in " ".join(lines[inner.lineno - 1 : inner.end_lineno])
            if project and not said:
                found.append(f"{path}:{inner.lineno} a project import inside {node.name} without `# lazy: why`")
    return sorted(set(found))


def test_modules_functions_and_imports_keep_the_house_rules():
    found = [
        p for f in sorted((ROOT / "boost_jax").rglob("*.py")) for p in problems(f.relative_to(ROOT), f.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_check_can_fail():
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    hidden = "def g():\n    from boost_jax import config\n    from boost_jax import errors  # lazy: a reason\n"
    padding = "\n" * (MAX_MODULE_LINES - long_function.count("\n") - hidden.count("\n") + 1)
    found = problems(Path("bad.py"), long_function + hidden + padding)
    assert len(found) == 3, found
    assert "lines (at most 600" in found[0] and "f is 101 lines" in found[1] and "inside g" in found[2]

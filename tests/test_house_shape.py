"""The house's shape, part two: every import names the module that defines the name (a package's
`__init__` may re-export, as its face), no folder of boost_jax/ holds more than 12 modules, the planner
stands on at most 8 floors, and module docstrings are at most 15 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FOLDER_MODULES = 12
MAX_PLANNER_FLOORS = 8
MAX_DOCSTRING_LINES = 15


def module_files(root: Path) -> dict[str, Path]:
    found = {}
    for f in sorted((root / "boost_jax").rglob("*.py")):
        if "configs" in f.relative_to(root).parts:  # configs are data (a link to configs/), not modules
            continue
        name = ".".join(f.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = f
    return found


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        for inner in [node] + (list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else []):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(inner.name)
            elif isinstance(inner, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif inner is not node and isinstance(inner, (ast.Import, ast.ImportFrom)):  # optional imports
                names.update((a.asname or a.name).split(".")[0] for a in inner.names)
    return names


def absolute(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def shim_uses(root: Path, mods: dict, defined: dict, path: Path, name: str, tree: ast.Module) -> list[str]:
    """`from M import x` or `M.x` where M is a plain module that does not define x."""
    found, aliases = [], {}

    def through(source: str | None, attr: str) -> bool:
        return (
            source in mods
            and mods[source].name != "__init__.py"
            and f"{source}.{attr}" not in mods
            and attr not in defined[source]
            and attr != "*"
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute(name, path, node)
            for a in node.names:
                if f"{source}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
                elif through(source, a.name):
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {a.name} through {source}")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
    rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.value.id in rebound:  # a local variable of the same name, not the module
                continue
            if through(aliases[node.value.id], node.attr):
                found.append(
                    f"{path.relative_to(root)}:{node.lineno} reads {node.attr} through {aliases[node.value.id]}"
                )
    return found


def shims(root: Path) -> list[str]:
    mods = module_files(root)
    trees = {m: ast.parse(f.read_text()) for m, f in mods.items()}
    defined = {m: top_level_names(t) for m, t in trees.items()}
    found = [p for m, t in trees.items() for p in shim_uses(root, mods, defined, mods[m], m, t)]
    for folder in ("tests", "benchmarks"):
        for f in sorted((root / folder).glob("*.py")):
            found += shim_uses(root, mods, defined, f, f.stem, ast.parse(f.read_text()))
    return sorted(found)


def folder_sizes(root: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, f in module_files(root).items():
        if f.name != "__init__.py":
            folder = str(f.parent.relative_to(root))
            sizes[folder] = sizes.get(folder, 0) + 1
    return sizes


def floors(root: Path, package: str) -> int:
    """How many floors `package` stands on: a module sits one floor above every module of the package it imports."""
    mods = {m: f for m, f in module_files(root).items() if m.startswith(package + ".")}
    deps = {}
    for m, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = absolute(m, f, node)
                out |= {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in mods}
                out |= {source} if source in mods else set()
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
        deps[m] = out - {m}
    memo: dict[str, int] = {}

    def floor(m: str, seen=frozenset()) -> int:
        if m not in memo:
            memo[m] = 1 + max((floor(d, seen | {m}) for d in deps[m] if d not in seen), default=0)
        return memo[m]

    return max(floor(m) for m in mods)


def long_docstrings(root: Path) -> list[str]:
    found = []
    for f in module_files(root).values():
        lines = (ast.get_docstring(ast.parse(f.read_text())) or "").splitlines()
        if len(lines) > MAX_DOCSTRING_LINES:
            found.append(f"{f.relative_to(root)}: a {len(lines)}-line module docstring (at most {MAX_DOCSTRING_LINES})")
    return found


def test_every_import_names_the_module_that_defines_it():
    found = shims(ROOT)
    assert not found, "import from the defining module:\n" + "\n".join(found)


def test_no_folder_holds_more_than_twelve_modules():
    over = {k: v for k, v in folder_sizes(ROOT).items() if v > MAX_FOLDER_MODULES}
    assert not over, over


def test_the_planner_stands_on_at_most_eight_floors():
    assert floors(ROOT, "boost_jax.planner") <= MAX_PLANNER_FLOORS


def test_module_docstrings_state_contracts_in_at_most_fifteen_lines():
    found = long_docstrings(ROOT)
    assert not found, "\n".join(found)


def test_the_shape_checks_can_fail(tmp_path):
    pkg = tmp_path / "boost_jax"
    (pkg / "deep").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "deep" / "__init__.py").write_text("")
    (pkg / "defines.py").write_text('"""' + "line\n" * 16 + '"""\nVALUE = 1\n')
    (pkg / "passes.py").write_text("from boost_jax.defines import VALUE\n")
    (pkg / "user.py").write_text(
        "from boost_jax import passes\nfrom boost_jax.passes import VALUE\nprint(passes.VALUE)\n"
    )
    chain = ["from boost_jax.deep import m0\n"] + [f"from boost_jax.deep import m{i - 1}\n" for i in range(1, 13)]
    for i, text in enumerate(chain):
        (pkg / "deep" / f"m{i}.py").write_text(text if i else "X = 1\n")
    found = shims(tmp_path)
    assert len(found) == 2 and "user.py:2 imports VALUE through boost_jax.passes" in found[0], found
    assert "reads VALUE through boost_jax.passes" in found[1]
    assert folder_sizes(tmp_path)["boost_jax/deep"] == 13
    assert floors(tmp_path, "boost_jax.deep") == 13
    assert len(long_docstrings(tmp_path)) == 1

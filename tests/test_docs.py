"""The documentation: the docs/ site builds with `mkdocs build --strict` (a broken link, a broken
anchor or a page left out of the nav fails it), and every path the README's layout and "where is"
tables name exists. The commands the pages show run in tests/test_readme.py."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `root`'s mkdocs.yml into `site`."""
    pytest.importorskip("mkdocs", reason="the test extra installs mkdocs: pip install -e '.[test]'")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strictly(tmp_path):
    done = mkdocs_build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    unbuilt = [p.name for p in (ROOT / "docs").glob("*.md") if not (site / p.stem / "index.html").exists()]
    assert unbuilt == ["index.md"] and (site / "index.html").exists(), unbuilt


@pytest.fixture
def copy_of_docs(tmp_path) -> Path:
    """mkdocs.yml and docs/ copied, for a test to break."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


@pytest.mark.parametrize(
    "broken, named",
    [
        ("[a page](no_such_page.md)", "no_such_page.md"),
        ("[a section](data.md#no-such-section)", "#no-such-section"),
        (None, "orphan.md"),  # a page that is not in the nav
    ],
    ids=["link", "anchor", "not_in_nav"],
)
def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(copy_of_docs, broken, named):
    if broken is None:
        (copy_of_docs / "docs" / "orphan.md").write_text("# Orphan\n")
    else:
        page = copy_of_docs / "docs" / "index.md"
        page.write_text(page.read_text() + f"\nSee {broken}.\n")
    done = mkdocs_build(copy_of_docs, copy_of_docs / "site")
    assert done.returncode != 0 and named in done.stdout + done.stderr, done.stdout + done.stderr


def table_paths(section: str, text: str) -> list[str]:
    """The repository paths in the table under `## {section}` of a README's `text`: each code span
    with a `/`, and a bare `NAME.py` beside one (in the same cell: a file of the same folder)."""
    body = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert body, f"README.md has no section '## {section}'"
    paths = []
    for row in (line for line in body.group(1).splitlines() if line.startswith("|")):
        for cell in row.strip("|").split("|"):
            spans = re.findall(r"`([^`\s]+)`", cell)
            folder = next((Path(s).parent for s in spans if "/" in s), None)
            for span in spans:
                if "/" in span:
                    paths.append(span)
                elif span.endswith(".py") and folder is not None:
                    paths.append(str(folder / span))
    assert paths, f"no paths in the table under '## {section}'"
    return paths


@pytest.mark.parametrize("section", ["Layout", "Where is..."])
def test_every_path_in_the_readme_tables_exists(section):
    missing = [p for p in table_paths(section, README) if not (ROOT / p).exists()]
    assert not missing, f"README.md '## {section}' names paths that do not exist (moved? fix the table): {missing}"


def test_a_moved_file_is_found_missing():
    """The check above reads what it should: a table row naming a file that is not there, and a bare
    name beside a folder's file, are paths it checks."""
    text = "## Where is...\n\n| a | b |\n|---|---|\n| x | `boost_jax/no_such.py` (and `gone.py`) |\n"
    paths = table_paths("Where is...", text)
    assert paths == ["boost_jax/no_such.py", "boost_jax/gone.py"]
    assert not any((ROOT / p).exists() for p in paths)


def test_the_readme_is_a_front_door():
    """At most 2,000 words, with the layout and the "where is..." tables starting in its first half."""
    words = README.split()
    assert len(words) <= 2000, f"README.md has {len(words)} words: move the detail to a docs/ page"
    for section in ("## Layout", "## Where is..."):
        before = README[: README.index(f"\n{section}\n")].split()
        assert len(before) < len(words) / 2, f"README.md: {section} starts after word {len(before)} of {len(words)}"

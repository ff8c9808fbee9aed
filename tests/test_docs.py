"""Every Python example in docs/ runs as written (the README's are in test_cli.py).

A block fenced ```` ```python ```` is a complete program and runs here in a fresh namespace; a
block fenced ```` ```python fragment ```` needs context a test cannot provide (a user's model,
several processes) and is only compiled, so that a syntax error still fails.
"""

# needs torch: docs/torch.md's examples import it

import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest
from conftest import experiment

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```python( fragment)?\n(.*?)^```", re.S | re.M)


def _blocks():
    out = []
    for path in sorted(DOCS.glob("*.md")):
        for i, m in enumerate(FENCE.finditer(path.read_text())):
            out.append(pytest.param(bool(m.group(1)), m.group(2), id=f"{path.name}-{i}"))
    return out


BLOCKS = _blocks()


def test_docs_have_runnable_examples():
    """The collection itself: examples exist and most of them run (not all fragments)."""
    runnable = [p for p in BLOCKS if not p.values[0]]
    assert len(runnable) >= 7 and len(runnable) > 2 * (len(BLOCKS) - len(runnable))


@pytest.mark.parametrize("fragment,code", BLOCKS)
def test_docs_example(fragment, code, request):
    program = compile(code, f"docs example {request.node.callspec.id}", "exec")
    if not fragment:
        # A real module in sys.modules: torch.compile (torch 2.11) imports a frame's module by
        # its __name__ to read its globals.
        module = types.ModuleType("docs_example")
        sys.modules["docs_example"] = module
        try:
            exec(program, module.__dict__)
        finally:
            del sys.modules["docs_example"]


ROOT = DOCS.parent
MARKER = re.compile(r"<!-- ([a-z0-9_]+):begin -->")
# Re-renders every table from the result files, as a user's `python experiments/X.py --report`.
_REPORTS = """
import runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--report"]
    runpy.run_path(script, run_name="__main__")
"""


def test_docs_tables_are_their_scripts_reports(tmp_path):
    """Every table between markers in docs/ and the README is what its script writes from its
    result file with --report (no hand-edited figure, no stale table, no table without a
    script that re-renders it)."""
    docs = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    markers = {name for p in docs for name in MARKER.findall(p.read_text())} - {"name"}
    scripts = [p for p in sorted((ROOT / "experiments").glob("*.py"))
               if "--report" in p.read_text() or "add_report_flag(" in p.read_text()]
    scripts = [p for p in scripts if p.name != "report.py"]
    written = {name for name in markers
               if any(f'"{name}"' in p.read_text() for p in scripts)}
    assert written == markers, f"tables no script re-renders: {sorted(markers - written)}"
    for p in docs:  # a second copy of a table would stay stale: --report rewrites the first
        names = MARKER.findall(p.read_text())
        assert len(names) == len(set(names)), f"{p.name}: a table's markers appear twice"
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "experiments", copy / "experiments",
                    ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    shutil.copy(ROOT / "README.md", copy / "README.md")
    subprocess.run([sys.executable, "-c", _REPORTS, *(p.name for p in scripts)],
                   cwd=copy / "experiments", check=True, capture_output=True, timeout=600)
    for p in docs:
        assert (copy / p.relative_to(ROOT)).read_text() == p.read_text(), (
            f"{p.name}: a table differs from its script's --report")


def test_write_between_markers_refuses_duplicated_markers(tmp_path):
    """A page holding a table's markers twice is an error, not a silent update of one copy."""
    write_between_markers = experiment("report").write_between_markers
    page = tmp_path / "page.md"
    page.write_text("<!-- t:begin -->\nold\n<!-- t:end -->\n")
    write_between_markers(page, "t", "new")
    assert "new" in page.read_text() and "old" not in page.read_text()
    page.write_text(page.read_text() * 2)
    with pytest.raises(ValueError, match="more than once"):
        write_between_markers(page, "t", "newer")


def test_gpu_commands_name_tests_that_exist():
    """The tests gpu.md's commands pass to ``gpu_check.py --tests`` (what a scarce GPU lease
    runs first) exist: a renamed or mistyped test id would make pytest stop with "not found"
    and spend the lease's test step on nothing."""
    text = (DOCS / "gpu.md").read_text()
    ids = [t for cmd in re.findall(r"gpu_check\.py[^`]*?--tests((?:[ \t]+(?:\\\n)?[ \t]*"
                                   r"tests/\S+)+)", text)
           for t in cmd.replace("\\\n", " ").split()]
    assert len(ids) >= 10, ids
    root = DOCS.parent
    for test_id in ids:
        path, _, name = test_id.partition("::")
        assert (root / path).is_file(), test_id
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (root / path).read_text(), re.M), \
                test_id

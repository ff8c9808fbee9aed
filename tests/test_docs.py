"""Every Python example in docs/ runs as written (the README's are in test_cli.py).

A block fenced ```` ```python ```` is a complete program and runs here in a fresh namespace; a
block fenced ```` ```python fragment ```` needs context a test cannot provide (a user's model,
several processes) and is only compiled, so that a syntax error still fails.
"""

import pathlib
import re
import sys
import types

import pytest

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

"""The command line and the README's quickstart run as documented."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import pytest

import hnlq_jax as hq
from hnlq_jax import __main__ as cli
from hnlq_jax.__main__ import main

ROOT = pathlib.Path(__file__).parent.parent
HERE = str(ROOT / "tests")  # a folder that exists


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "jax" in out and "backend" in out and "E8" in out
    native = (f"native: built ({hq.kernels.cpu.isa()})" if hq.kernels.cpu.available()
              else "native: the extension")
    assert native in out
    mosaic = hq.kernels.mosaic_gpu
    assert ("Mosaic GPU gemv and decode_matmul: available" in out) == mosaic.available()
    cpu = "native" if hq.kernels.cpu.available() and jax.default_backend() == "cpu" else None
    if cpu:  # what None runs on this machine, every operation named
        assert f"D4 q=4 M=2): matmul {cpu}, decode {cpu}; rotation (n=384) {cpu}" in out


def test_info_without_the_native_extension():
    """Where the extension is not built (a source checkout, no compiler at install time),
    ``info`` says so and how to build it, and the library works on its XLA paths; the
    message is not Python's circular-import hint of a name imported from a package still
    initializing."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class NotBuilt(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "hnlq_jax.kernels._cpu":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NotBuilt())
        import numpy as np
        import hnlq_jax as hq
        from hnlq_jax.__main__ import main
        assert not hq.kernels.cpu.available()
        main(["info"])
        c = hq.HNLQConfig("D4", 4, 2)
        codes = hq.encode_rows(np.ones((4, 8), np.float32), c)
        print(np.asarray(hq.matmul(np.ones((1, 8), np.float32), codes)).shape)
        """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    native = next(line for line in run.stdout.splitlines() if "native:" in line)
    assert "_cpu is not built" in native and "pip install -e ." in native, native
    assert "circular" not in run.stdout
    assert run.stdout.splitlines()[-1] == "(1, 4)"


def test_demo_small(capsys):
    """demo is the default command (options without it) and counts take float notation."""
    assert main(["--lattice", "Z2", "--q", "3", "--n", "3e3"]) == 0
    out = capsys.readouterr().out
    assert "3,000 iid N(0,1) vectors" in out
    assert "dB above D(R)" in out and "overload" in out and "vec/s" in out and "packed" in out
    db = float(re.search(r"([0-9.]+) dB above", out).group(1))
    assert 1.0 < db < 6.0


@pytest.mark.parametrize("argv,message", [
    (["demo", "--q", "1", "--n", "10"], "demo: error: HNLQConfig.q must be in 2..256"),
    (["rd", "--q", "1", "--n", "10"], "rd: error: HNLQConfig.q must be in 2..256"),
    (["--n", "0.5"], "expected a whole number >= 1, got '0.5'"),
    (["demo", "--n", "many"], "expected a number such as 1000 or 1e6, got 'many'"),
    (["demo", "--n", "1e30"], "expected at most 2.15e+09 (2^31 - 1), got '1e30'"),
    (["demo", "--n", "inf"], "expected a whole number >= 1, got 'inf'"),  # (an OverflowError)
    (["rd", "--json", HERE, "--force"], f"{HERE!r} is a folder; name a file"),
])
def test_demo_bad_arguments(capsys, argv, message):
    """Usage errors of the command that was run (its usage line, not the top-level one)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert message in err
    assert err.startswith(f"usage: python -m hnlq_jax {argv[0] if argv[0] != '--n' else 'demo'}")
    assert "beta grid search" not in out  # rd refuses before it prints its table's header


def test_readme_examples_run():
    """Every Python block of the README, in order, in one namespace (later ones build on the
    quickstart)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    scope = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README python block {i}", "exec"), scope)


def test_readme_top_commands():
    """The README opens with exactly the two documented install-and-run commands."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text.split("## Quickstart")[0], re.S)
    assert len(blocks) == 2
    assert blocks[0].strip().endswith("python -m hnlq_jax demo")
    assert blocks[1].strip().endswith("python -m pytest -q")
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_out_of_memory_is_a_usage_error(capsys, monkeypatch):
    def demo(args):
        raise MemoryError
    monkeypatch.setattr(cli, "demo", demo)
    with pytest.raises(SystemExit) as e:
        main(["demo", "--n", "2e9"])
    assert e.value.code == 2
    assert "not enough memory for --n 2000000000: try a smaller --n" in capsys.readouterr().err


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """The output is written to a temporary file renamed onto the path: a write that fails
    leaves neither (a stray .tmp-<name> was left)."""
    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cli._write_atomic(tmp_path / "out.json", fail)
    assert list(tmp_path.iterdir()) == []
    cli._write_atomic(tmp_path / "out.json", lambda t: t.write_text("{}"))
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]

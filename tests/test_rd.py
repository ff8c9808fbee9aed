"""The rate-distortion experiment: the paper's numbers, the table, the plot and the command."""

import json
import math

import numpy as np
import pytest
from conftest import load_golden

from hnlq_jax import rd
from hnlq_jax.__main__ import main


@pytest.mark.golden
def test_reproduces_reference_grid_search():
    """Z2 q=3 M=1 on the paper's sample gives the reference's beta_search_best (float64)."""
    b, mse, H, R, f, p = load_golden("Z2_q3_M1.npz")["beta_search_best"]
    seen = []
    points = rd.rate_distortion(["Z2"], [3], [1], callback=seen.append)
    assert len(points) == 2 and seen == points
    hnlq, vor = points
    assert (hnlq.code, vor.code, vor.q, vor.M) == ("hnlq", "voronoi", 9, 1)
    assert hnlq.beta == pytest.approx(b, rel=1e-9)
    assert hnlq.mse == pytest.approx(mse, rel=1e-9)
    assert hnlq.entropy_T == pytest.approx(H, rel=1e-9, abs=1e-12)
    assert hnlq.rate == pytest.approx(R, rel=1e-9)
    assert hnlq.f_dB == pytest.approx(10 * math.log10(f), abs=1e-9)
    assert hnlq.overload_rate == pytest.approx(p, abs=1e-12)


def test_table_and_plot(tmp_path):
    pts = rd.rate_distortion(["A2"], [3], [1, 2], n=300, voronoi=False)
    lines = rd.format_table(pts).splitlines()
    assert len(lines) == 3 and "f (dB)" in lines[0] and lines[2].split()[:4] == ["A2", "hnlq", "3", "2"]
    rd.plot(pts, tmp_path / "rd.png")
    assert (tmp_path / "rd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_grid_is_valid(monkeypatch):
    """The default table runs (no config refused): the Voronoi code at q^2 only where Codes hold
    its codebook (E8 at q = 64 has 64^8 > 2^32 entries)."""
    monkeypatch.setattr(rd, "_point", lambda *job, n, seed: job)  # the job list, no grid search
    jobs = rd.rate_distortion()
    assert len(jobs) == 4 * 3 * 3 + 4 * 3 - 1
    assert ("D4", 64, 1, "voronoi") in jobs and ("E8", 16, 1, "voronoi") in jobs
    assert ("E8", 64, 1, "voronoi") not in jobs


def test_invalid_config_fails_before_running():
    with pytest.raises(ValueError, match="q must be in 2..256"):
        rd.rate_distortion(["D4"], [3, 1], [1])


def test_cli_rd(tmp_path, capsys):
    png, js = tmp_path / "rd.png", tmp_path / "rd.json"
    assert main(["rd", "--lattices", "Z2", "--q", "3", "--M", "1", "--n", "500", "--no-voronoi",
                 "--plot", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "f (dB)" in out and "Z2      hnlq       3  1" in out
    rows = json.loads(js.read_text())
    assert len(rows) == 1 and rows[0]["lattice"] == "Z2" and np.isfinite(rows[0]["f_dB"])
    assert png.exists()
    with pytest.raises(SystemExit) as e:
        main(["rd", "--lattices", "X9"])
    assert e.value.code == 2
    assert "unknown lattice 'X9'" in capsys.readouterr().err


def test_cli_rd_output_paths(tmp_path, capsys, monkeypatch):
    """Output paths are checked before any work; an existing file needs --force and is then
    replaced whole (no temporary file left behind)."""
    def no_work(*args, **kwargs):
        raise AssertionError("the grid search ran before the output paths were checked")

    monkeypatch.setattr(rd, "rate_distortion", no_work)
    args = ["rd", "--lattices", "Z2", "--q", "3", "--M", "1", "--n", "300", "--no-voronoi"]
    with pytest.raises(SystemExit) as e:
        main(args + ["--json", str(tmp_path / "nodir" / "rd.json")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    js = tmp_path / "rd.json"
    js.write_text("keep")
    with pytest.raises(SystemExit) as e:
        main(args + ["--json", str(js)])
    assert e.value.code == 2 and "exists; pass --force" in capsys.readouterr().err
    assert js.read_text() == "keep"
    monkeypatch.undo()
    assert main(args + ["--json", str(js), "--force"]) == 0
    assert json.loads(js.read_text())[0]["lattice"] == "Z2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rd.json"]

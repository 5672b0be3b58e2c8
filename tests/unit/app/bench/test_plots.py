"""The figures of a run and of a sweep are written as PNGs; matplotlib only when asked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cache.app.bench import plots
from pd_cache.app.bench.summary import summarize
from tests.unit.app.bench.runs import run_records, run_summary, sweep_summary

PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000


def test_importing_the_bench_results_side_imports_no_heavy_module():
    code = ("import sys; import pd_cache.app.bench.plots, pd_cache.app.bench.summary, "
            "pd_cache.app.bench.server_metrics; "
            "print(sorted(m for m in ('matplotlib', 'torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_without_matplotlib_the_plots_say_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # import raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[plots\]'"):
        plots.plot_run(run_records(), run_summary(), tmp_path)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[plots\]'"):
        plots.plot_sweep([], tmp_path)


def test_plot_run_writes_the_ttft_cdf_and_the_turns(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.plot_run(run_records(), run_summary(), tmp_path / "plots")
    assert [p.name for p in paths] == ["ttft_cdf.png", "turns.png"]
    for path in paths:
        assert_png(path)


def test_plot_run_of_a_run_without_completions(tmp_path):
    pytest.importorskip("matplotlib")
    failed = [r for r in run_records() if not r.ok]
    for path in plots.plot_run(failed, summarize(failed, duration_s=1.0), tmp_path):
        assert_png(path)


def test_plot_sweep_one_line_per_cache_label(tmp_path):
    pytest.importorskip("matplotlib")
    sweep = [sweep_summary(r, c, 10.0 if c else 20.0) for r in (1.0, 4.0, 2.0, "inf")
             for c in (True, False)]
    [path] = plots.plot_sweep(sweep, tmp_path)
    assert path.name == "sweep.png"
    assert_png(path)
    with pytest.raises(ValueError, match="no config"):
        plots.plot_sweep([summarize([], duration_s=1.0)], tmp_path)

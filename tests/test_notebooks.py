"""The figure notebooks run end to end on traces recorded from a tiny random model, and write their PNGs."""

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.fixture(scope="module")
def traces_path(tmp_path_factory):
    from locality.record import main

    out = tmp_path_factory.mktemp("nb_traces")
    return main(model="random-llama", prompts="spec_bench", per_category=1, categories=["writing", "coding", "qa", "math_reasoning"],
                max_new_tokens=24, out=str(out), progress=False)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(nb, traces_path, tmp_path):
    jupytext = pytest.importorskip("jupytext", reason="the notebooks extra is not installed")
    papermill = pytest.importorskip("papermill", reason="the notebooks extra is not installed")
    ipynb = tmp_path / f"{nb.stem}.ipynb"
    jupytext.write(jupytext.read(nb), ipynb)
    figures = tmp_path / "figures"
    papermill.execute_notebook(str(ipynb), str(tmp_path / f"{nb.stem}.out.ipynb"), kernel_name="python3",
                               language="python", cwd=str(Path(__file__).parent.parent), progress_bar=False,
                               parameters={"traces_path": str(traces_path), "out_dir": str(figures)})
    pngs = sorted(figures.glob("*.png"))
    assert pngs, "the notebook wrote no figure"
    for p in pngs:
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"
        assert (figures / f"{p.stem}.html").exists()

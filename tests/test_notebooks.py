"""The figure notebooks run end to end on traces and bench results from a tiny random model, and write their
PNGs. Every notebook gets every parameter below; each uses the ones its parameters cell names."""

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.fixture(scope="module")
def traces_path(tmp_path_factory):
    from locality.record import main

    out = tmp_path_factory.mktemp("nb_traces")
    return main(model="random-llama", prompts="spec_bench", per_category=1, categories=["writing", "coding", "qa", "math_reasoning"],
                max_new_tokens=24, out=str(out), progress=False)


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory):
    """A bench table (methods and a drafter with two vocabs) and a calibration cache, from a tiny model."""
    import json

    import torch

    from engine import calibrate as cal
    from engine.bench import RESULTS_FILE, run_bench
    from engine.config import SpecConfig
    from engine.models import load_model

    out = tmp_path_factory.mktemp("nb_bench")
    loaded = load_model("random-llama", vocab_size=512, num_layers=2, seed=2)
    run_bench(methods="ar,pld,unispec", drafter="layerskip", vocab="full,microspec", prompts="spec_bench",
              per_category=1, categories=["writing", "qa"], max_new_tokens=12, loaded=loaded, warmup=0,
              out=out, progress=False, show=False,
              config={"drafter_layers": "first:1", "w_max": 64, "eagle_total_tokens": 10, "draft_size": 4})
    prompts = [torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    rec = cal.calibrate(loaded[0], prompts, "unispec", grid=[1, 2, 4, 8], cfg=SpecConfig.preset("unispec", max_new_tokens=12),
                        eos_ids=[], save=False, progress=False)
    (out / "calibration.json").write_text(json.dumps({rec["key"]: rec}))
    return {"results_path": str(out / RESULTS_FILE), "calibration_file": str(out / "calibration.json")}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(nb, traces_path, bench_results, tmp_path):
    jupytext = pytest.importorskip("jupytext", reason="the notebooks extra is not installed")
    papermill = pytest.importorskip("papermill", reason="the notebooks extra is not installed")
    ipynb = tmp_path / f"{nb.stem}.ipynb"
    jupytext.write(jupytext.read(nb), ipynb)
    figures = tmp_path / "figures"
    papermill.execute_notebook(str(ipynb), str(tmp_path / f"{nb.stem}.out.ipynb"), kernel_name="python3",
                               language="python", cwd=str(Path(__file__).parent.parent), progress_bar=False,
                               parameters={"traces_path": str(traces_path), "out_dir": str(figures), **bench_results})
    pngs = sorted(figures.glob("*.png"))
    assert pngs, "the notebook wrote no figure"
    for p in pngs:
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"
        assert (figures / f"{p.stem}.html").exists()

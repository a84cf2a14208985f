"""The whole pipeline on real pretrained weights (stories260K from ../shared/data), where present."""

from __future__ import annotations

import pandas as pd
import pytest

from ffkv.corpus import CorpusSpec, shared_data_dir
from ffkv.experiments import analyze
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    data = shared_data_dir()
    if data is None or not (data / "models" / "stories260K").is_dir():
        pytest.skip("needs ../shared/data/models/stories260K")
    loaded = load_model(str(data / "models" / "stories260K"))
    out = tmp_path_factory.mktemp("real") / "run"
    spec = CorpusSpec(source=str(data / "tinystories" / "sample.txt"), unit="sentence")
    build_index(loaded, spec, out, IndexOptions(top_k=10), progress=False)
    analyze(out, eval_corpus=spec, n_eval=40, progress=False, loaded=loaded)
    return out, loaded


def test_every_experiment_writes_tables_and_figures(real_run):
    out, loaded = real_run
    for name in ("patterns", "ablations", "values", "composition", "refinement"):
        table = pd.read_parquet(out / "metrics" / f"{name}.parquet")
        assert len(table) > 0
        assert (out / "figures" / f"{name}.png").stat().st_size > 1000
    assert pd.read_parquet(out / "metrics" / "values.parquet")["layer"].nunique() == loaded.view.n_layers


def test_real_keys_depend_most_on_the_last_token(real_run):
    # Paper Figure 3: removing the last token changes the coefficient most.
    out, _ = real_run
    table = pd.read_parquet(out / "metrics" / "ablations_prefixes.parquet")
    change = table.groupby("variant")["relative_change"].mean()
    assert change["last"] < change["first"]

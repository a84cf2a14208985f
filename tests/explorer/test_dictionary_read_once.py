"""A run's sparse dictionary is read again and hashed once where its lookups are built: by `ffkv serve`, whose
latent pages then use the same reading, and by `ffkv analyze`, whose latent studies share it with the lookups."""

from __future__ import annotations

import pytest

from ffkv.corpus import CorpusSpec
from ffkv.dictionaries import files
from ffkv.experiments import analyze
from ffkv.explorer.data import ExplorerData
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.memories.sets import Latents
from ffkv.models import load_model
from ffkv.models.default_corpus import default_corpus_path
from ffkv.models.tiny_lm import tiny_transcoders_path
from ffkv.store.run import RunDir


@pytest.fixture(scope="module")
def tiny():
    return load_model("ffkv-tiny")


@pytest.fixture()
def run(tmp_path, tiny):
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=40, shuffle_seed=0)
    build_index(tiny, spec, tmp_path / "run", IndexOptions(top_k=4, control_keys=0), progress=False,
                dictionary=tiny_transcoders_path())
    return tmp_path / "run"


def _hashes(monkeypatch) -> list[str]:
    """The dictionary files hashed from now on (`ffkv.dictionaries.files.sha256`)."""
    hashed: list[str] = []
    sha256 = files.sha256

    def counted(path):
        hashed.append(str(path))
        return sha256(path)

    monkeypatch.setattr(files, "sha256", counted)
    return hashed


def _one_reading(run, tiny, monkeypatch) -> list[str]:
    hashed = _hashes(monkeypatch)
    manifest = RunDir(run).manifest()
    Latents.of_run(tiny.view, manifest.index.get("dictionary"), None, run)
    once = sorted(hashed)
    hashed.clear()
    assert once  # the reading hashes the dictionary's files: what the counts below compare with
    return once


def test_serve_building_the_lookups_reads_the_dictionary_once_for_them_and_its_latent_pages(run, tiny, monkeypatch):
    once = _one_reading(run, tiny, monkeypatch)
    hashed = _hashes(monkeypatch)
    data = ExplorerData(run, loaded=tiny)  # no lookups yet: they are built here
    assert data.latents is not None and data.latents.memories() is not None
    assert sorted(hashed) == once


def test_analyze_reads_the_dictionary_once_for_a_latent_study_and_the_lookups(run, tiny, monkeypatch):
    once = _one_reading(run, tiny, monkeypatch)
    hashed = _hashes(monkeypatch)
    analyze(run, only="values,lookups", loaded=tiny, n_eval=40, progress=False)
    assert sorted(hashed) == once

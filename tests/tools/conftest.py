"""Fixtures of the explain and score tests: the planted model's indexed run, and a private copy of it per test."""

from __future__ import annotations

import pytest

from support.explain_runs import planted_run
from support.runs import copy_run


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(run, loaded): the planted model's indexed run (top-10, both signs, 256 control memories)."""
    return planted_run(tmp_path_factory.mktemp("planted"))


@pytest.fixture
def fresh(planted, tmp_path):
    """(a copy of the planted run that the test may write into, loaded)."""
    run, loaded = planted
    return copy_run(run, tmp_path / "run"), loaded


@pytest.fixture(scope="module")
def planted_latents(tmp_path_factory):
    """(run, loaded): the planted model's run indexed with `planted_dictionary` (a transcoder of layer 0 whose
    latent PLANTED_LATENT fires on the planted character alone), 16 control memories and control latents."""
    from support.explain_runs import planted_latent_run

    return planted_latent_run(tmp_path_factory.mktemp("planted_latents"))


@pytest.fixture
def fresh_latents(planted_latents, tmp_path):
    """(a copy of the planted latents' run that the test may write into, loaded)."""
    run, loaded = planted_latents
    return copy_run(run, tmp_path / "run"), loaded

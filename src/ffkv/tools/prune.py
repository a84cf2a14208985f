"""`ffkv prune`: write a smaller model without the keys a criterion removes (beyond the paper, docs/definitions.md).

The criteria and their removal orders are the pruning study's (`ffkv.experiments.pruning`); this tool applies one
of them at one share to the run's model and writes the result in its original format, checked to give the
masked model's logits before it is renamed into place. The census criterion reads the run's census only where
the run records it as computed, and the written ``ffkv_pruning.json`` says on what (`census_provenance`).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from ffkv.errors import FfkvError, StorageError, one_line
from ffkv.experiments.common import open_run
from ffkv.experiments.heldout import run_threshold
from ffkv.experiments.lookups import SAMPLE_EXAMPLES, SAMPLE_MAX_TOKENS, corpus_sample, sample_batches
from ffkv.experiments.pruning import (NEEDS_SAMPLE, census_provenance, check_criterion, key_statistics,
                                      keys_to_remove, read_census, removal_orders)
from ffkv.memories.pruning import intermediate_size_field, masked, removal_count, shrink_model
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic
from ffkv.store.run import RunDir

#: Most examples of the corpus sample the written model is checked on.
VERIFY_EXAMPLES = 4
#: Largest |pruned - masked| logit difference accepted, relative to the largest |logit|, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits.float()


def prune(run_dir: str | Path, criterion: str, share: float, out: str | Path, seed: int = 0,
          loaded: LoadedModel | None = None, device: str = "cpu") -> Path:
    """Write a smaller model without the keys `criterion` removes at `share`: `ffkv prune`.

    The run's model loses the same number of keys in every layer (`removal_count`); the result is written in
    its original format (`save_pretrained`, with its tokenizer and ``ffkv_pruning.json``: criterion, share,
    the removed keys of every layer) into a temporary folder beside `out`, loaded back with
    `ffkv.models.load_model`, checked to give the masked model's logits on a few of the run's examples, and
    only then renamed to `out`.

    Args:
        run_dir: a complete run (its manifest names the model).
        criterion: one of `CRITERIA`.
        share: share of each layer's keys to remove, 0 <= share < 1.
        out: a folder that does not exist yet.
        seed: the corpus sample's and the random criterion's seed (as `ffkv analyze --seed`).
        loaded: the run's model, already loaded (it is copied, never changed).
    """
    check_criterion(criterion)
    removal_count(2, share)  # validates the share before any work
    out = Path(out)
    if out.exists():
        raise FfkvError(f"--out {str(out)!r} exists; give a new folder (ffkv prune never overwrites)")
    census, provenance = None, None
    if criterion == "census":  # before loading the model
        provenance = census_provenance(RunDir(run_dir))
        census = read_census(RunDir(run_dir))
    run, manifest, given = open_run(run_dir, loaded, device)
    if loaded is not None:
        given = copy.copy(given)
        given.model = copy.deepcopy(given.model)
        given.view = MemoryView(given.model)
    view = given.view
    intermediate_size_field(view.model)  # refuses unsupported families before any pass
    if getattr(given.tokenizer, "hf", None) is None:
        raise FfkvError("ffkv prune saves the model's Hugging Face tokenizer beside it; this model has none")
    sample = corpus_sample(run, n=SAMPLE_EXAMPLES, seed=seed, max_tokens=SAMPLE_MAX_TOKENS)
    # the activation frequency's rule is the run's (s_l of its held-out examples): read only where it is used
    threshold, source = run_threshold(run, manifest, given, seed) if criterion == "activation_frequency" \
        else (None, None)
    stats = key_statistics(given, token_lists=sample if criterion in NEEDS_SAMPLE else None, threshold=threshold)
    orders = removal_orders(criterion, view, stats, census, seed)
    removed = keys_to_remove(orders, share)

    probe = sample_batches(given, sample[:VERIFY_EXAMPLES], batch_size=VERIFY_EXAMPLES)
    probe = probe[0] if probe else None
    if probe is not None:
        ids, mask = probe.input_ids.to(view.device), probe.attention_mask.to(view.device)
        with torch.no_grad(), masked(view, removed):
            expected = _logits(given.model, ids, mask)
    d_before = view.d_m
    d_after = shrink_model(view, removed)
    try:
        with atomic.atomic_folder(out) as tmp:
            from ffkv.models.tiny_lm import quiet_transformers

            with quiet_transformers():  # transformers' own bars; the CLI prints one line
                given.model.save_pretrained(tmp)
                given.tokenizer.hf.save_pretrained(tmp)
            for written in tmp.iterdir():
                atomic.make_readable(written)  # some writers make 0600 files; a model folder is meant to be shared
            (tmp / "ffkv_pruning.json").write_text(json.dumps({
                "source_model": manifest.model.id, "run": str(Path(run_dir)), "criterion": criterion, "share": share,
                "seed": seed, "d_m_before": d_before, "d_m_after": d_after, "removed_per_layer": d_before - d_after,
                "statistics_sample": {"examples": stats.examples, "positions": stats.positions,
                                      "active_threshold": source},
                **({"census_provenance": provenance} if provenance is not None else {}),
                "removed": {str(layer): keys.tolist() for layer, keys in removed.items()},
            }, indent=1) + "\n")
            if probe is not None:
                _verify(tmp, given, ids, mask, expected, d_after)
    except FileExistsError:
        raise FfkvError(f"--out {str(out)!r} appeared while pruning; nothing was written") from None
    except OSError as error:
        raise StorageError(f"cannot write the pruned model beside {out}: {one_line(error)}; nothing was written") \
            from None
    except Exception as error:  # noqa: BLE001 - safetensors and tokenizers report a full disk as their own errors
        errno_ = atomic.written_errno(error)
        if errno_ is None:
            raise
        raise StorageError(f"cannot write the pruned model beside {out}: {os.strerror(errno_)}; nothing was "
                           "written") from None
    return out


def _verify(folder: Path, given: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, expected: torch.Tensor,
            d_m: int) -> None:
    """The written model, loaded back, has d_m memories per layer and the masked model's logits."""
    from ffkv.models import load_model

    back = load_model(str(folder), dtype=given.dtype, device=given.device)
    if back.view.d_m != d_m:
        raise FfkvError(f"the written model has {back.view.d_m} memories per layer, expected {d_m}")
    with torch.no_grad():
        got = _logits(back.model, ids, mask)
    real = mask.bool()
    scale = float(expected[real].abs().max()) if real.any() else 1.0
    worst = float((got[real] - expected[real]).abs().max()) if real.any() else 0.0
    if worst > TOLERANCE.get(back.model.dtype, 1e-4) * max(scale, 1.0):
        raise FfkvError(f"the pruned model's logits differ from the masked model's by {worst:.3g} "
                        f"(largest logit {scale:.3g}); nothing was written")


__all__ = ["prune"]

"""A run described in a few readable rows, for the report's and the explorer's overview."""

from __future__ import annotations

from ffkv.store.manifest import Manifest


def manifest_summary(manifest: Manifest) -> list[tuple[str, str]]:
    """(field, value) rows describing a run: model, corpus, options, timings, counts."""
    model = manifest.model
    rows = [("model", f"{model.id} ({model.family}, {model.dtype})"),
            ("shape", f"{model.n_layers} layers x {model.d_m} memories, d_model {model.d_model}, "
                      f"vocabulary {model.vocab_size}"),
            ("residual", model.resid_mid),
            ("corpus", ", ".join(f"{k}={v}" for k, v in manifest.corpus.items() if v is not None)),
            ("index", ", ".join(f"{k}={v}" for k, v in manifest.index.items() if k != "batching")),
            ("counts", ", ".join(f"{k}: {v:,}" if isinstance(v, int) else f"{k}: {v}"
                                 for k, v in manifest.counts.items())),
            ("timings", ", ".join(f"{k}: {v:.1f} s" if isinstance(v, (int, float)) else f"{k}: {v}"
                                  for k, v in manifest.timings.items())),
            ("status", f"{manifest.status} (updated {manifest.updated or '?'})")]
    return rows

"""Load a model and its tokenizer by name: a Hugging Face hub id, a local directory, or an ffkv name.

Named models (such as the embedded ``ffkv-tiny``) and special checkpoint layouts
(such as fairseq's) register a loader in `LOADERS`; everything else goes through
Hugging Face's Auto classes. Nothing is downloaded unless the user names a hub id
on a machine with a network.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ffkv.errors import FfkvError
from ffkv.memories.view import MemoryView
from ffkv.models import hub
from ffkv.models.safe_load import refusal
from ffkv.models.tokenizer import HFTokenizer, Tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Config fields that give the length of a model's position table (Hugging Face, ffkv's own, fairseq).
POSITION_FIELDS = ("n_positions", "max_position_embeddings", "max_positions", "n_ctx")
#: Model types whose learned positions start after the padding id (RoBERTa's offset).
PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm")


@dataclass
class LoadedModel:
    """A model ready for analysis: weights in eval mode, its tokenizer and memory view."""

    model: nn.Module
    tokenizer: Tokenizer
    view: MemoryView
    model_id: str
    dtype: str
    device: str
    _weights_hash: str | None = field(default=None, repr=False, compare=False)

    @property
    def max_positions(self) -> int | None:
        """The most tokens one sequence may hold: the model's position table (None: not known).

        Rotary models have no table, but their config names the length they were
        trained on; beyond it their activations are out of distribution, so it counts too.
        """
        config = getattr(self.model, "config", None)
        for name in POSITION_FIELDS:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                if getattr(config, "model_type", "") in PADDING_OFFSET_POSITIONS:
                    pad = getattr(config, "pad_token_id", None)
                    value -= (1 if pad is None else int(pad)) + 1
                return value
        return None

    @property
    def special_ids(self) -> frozenset[int]:
        """Token ids of the tokenizer's special tokens (BOS, EOS, CLS, SEP, ...): never triggers, never removed,
        never counted as content. Every reader of them asks here."""
        return frozenset(int(i) for i in (getattr(self.tokenizer, "special_ids", ()) or ()))

    def weights_hash(self) -> str:
        """sha256 over every parameter and buffer (names, shapes and bytes), in name order.

        Computed once per loaded model (the weights are frozen after loading).
        """
        if self._weights_hash is None:
            self._weights_hash = self._hash_weights()
        return self._weights_hash

    def _hash_weights(self) -> str:
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            # The array's own buffer, not a bytes copy of it (half the memory traffic; same bytes hashed).
            h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy())
        return h.hexdigest()


#: A loader claims a model name (returns None when it does not apply) and loads it.
Loader = Callable[[str, torch.dtype, str], "tuple[nn.Module, Tokenizer] | None"]
LOADERS: list[Loader] = []


def register_loader(loader: Loader) -> Loader:
    """Add a loader tried before the Hugging Face Auto classes (usable as a decorator)."""
    LOADERS.append(loader)
    return loader


def _custom_code_refusal(error: BaseException, name: str) -> FfkvError | None:
    """The one line for a model that transformers refused because it needs code from its own files (``auto_map``;
    ffkv never runs it, and never asks), or None when `error` is not that refusal."""
    if "trust_remote_code" not in str(error):
        return None
    return FfkvError(f"the model {name!r} is refused: it needs custom code from its own files (its config names "
                     "Python modules in auto_map), and ffkv never runs code from a model; use a model of a "
                     "family transformers supports natively")


def _load_hf(name: str, dtype: torch.dtype, device: str) -> tuple[nn.Module, Tokenizer]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    # A hub id the cache does not hold needs the hub: ask whether it answers before transformers retries for
    # half a minute; unreachable, the files are read from the cache only (no retries at all).
    offline = not Path(name).exists() and not hub.in_cache(name) and not hub.reachable()
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=offline, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - HF raises many types; the user needs one line
        refused = _custom_code_refusal(exc, name)
        if refused is not None:
            raise refused from None
        if Path(name).is_dir():
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise FfkvError(f"cannot load the model in {name!r}: its config.json is missing or not a model's "
                            f"configuration ({type(exc).__name__}: {first})") from None
        if offline:
            raise FfkvError(f"cannot load model {name!r}: not a local model directory, an ffkv model name, or a "
                            f"Hugging Face hub id in the local cache, and {hub.endpoint()} cannot be reached from "
                            "here (offline?)") from None
        raise FfkvError(
            f"cannot load model {name!r}: not a local model directory, an ffkv model name, "
            f"or a reachable Hugging Face hub id ({type(exc).__name__})"
        ) from None
    from ffkv.memories.architectures import ARCHITECTURES, supported_families

    arch = next((a for a in ARCHITECTURES if config.model_type in a.model_types), None)
    if arch is None:
        raise FfkvError(
            f"unsupported architecture {config.model_type!r} in {name!r}; ffkv supports: {supported_families()}"
        )
    auto = AutoModelForMaskedLM if arch.encoder else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(name, dtype=dtype, local_files_only=offline, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001
        refused = _custom_code_refusal(exc, name)
        if refused is not None:
            raise refused from None
        unsafe = refusal(exc, name, "the model weights in")
        if unsafe is not None:
            raise unsafe from None
        raise FfkvError(f"cannot load model {name!r}: {exc}".splitlines()[0]) from None
    return model, HFTokenizer(tokenizer, vocab_size=model.get_output_embeddings().weight.shape[0])


def _written_as_path(name: str) -> bool:
    """Whether a model name can only be a path: it starts like one ("/", ".", "~"), has more parts than a hub id's
    ORG/NAME, or a checkpoint's suffix."""
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
            or Path(name).suffix in (".gguf", ".pt", ".bin", ".safetensors"))


def load_model(name: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a model for analysis.

    Args:
        name: ``ffkv-tiny`` (or another registered name), a local directory in
            Hugging Face (or fairseq) format, a GGUF file (``ffkv.models.gguf_lm``), or a hub id.
        dtype: ``float32`` (exact reference), ``float16`` or ``bfloat16``.
        device: a torch device string such as ``cpu`` or ``cuda:0``.
    """
    if dtype not in DTYPES:
        raise FfkvError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    try:
        torch.device(device)
    except RuntimeError:
        raise FfkvError(f"unknown device {device!r}; use e.g. cpu, cuda or cuda:1") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FfkvError(f"device {device!r} asked for, but no CUDA GPU is available here; use --device cpu")
    if not Path(name).is_absolute() and Path(name).exists():
        # A local model named relative to this folder: a run records it whole, so that `ffkv serve RUN` and the
        # other commands that load a run's model find it from any folder.
        name = str(Path(name).resolve())
    for loader in LOADERS:
        found = loader(name, DTYPES[dtype], device)
        if found is not None:
            model, tokenizer = found
            break
    else:
        if Path(name).exists() and not Path(name).is_dir():
            raise FfkvError(f"model path {name!r} is a file; give the model's directory (or a .gguf file)")
        if not Path(name).exists() and _written_as_path(name):
            raise FfkvError(f"model {name!r}: no such file or folder (a hub id is written ORG/NAME)")
        model, tokenizer = _load_hf(name, DTYPES[dtype], device)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, MemoryView(model), name, dtype, device)

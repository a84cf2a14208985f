"""Models held in one GGUF file (llama.cpp, Ollama, LM Studio): ``--model PATH.gguf``.

transformers reads the file with the ``gguf`` package: its metadata give the configuration and the
tokenizer, its tensors are dequantized to the dtype asked for (a quantized file's weights are then
those of the quantized model, exactly; not the original model's). A GGUF file holds metadata and
tensors only, so opening one runs nothing from it. transformers reads the architectures it maps to
its own classes (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, GPT-2, ...); ffkv then needs the family
among its own (`ffkv.memories.architectures`), as for any model.

Needs the ``gguf`` and ``accelerate`` packages: ``pip install 'ffkv[gguf]'``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch import nn

from ffkv.errors import FfkvError
from ffkv.models.loading import register_loader
from ffkv.models.tokenizer import HFTokenizer, Tokenizer

SUFFIX = ".gguf"


def is_gguf(name: str) -> bool:
    """Whether `name` names a GGUF file (by its suffix; whether it is one is checked on reading)."""
    return Path(name).suffix.lower() == SUFFIX


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Tokenizer]:
    """The causal LM and tokenizer of a GGUF file, dequantized to `dtype`.

    Raises:
        FfkvError: no such file, the ``gguf`` package missing, not a GGUF file or one transformers
            cannot map to a model, or a family ffkv does not support.
    """
    path = Path(path)
    if not path.is_file():
        raise FfkvError(f"no GGUF file at {str(path)!r}")
    for package in ("gguf", "accelerate"):  # transformers reads the file with both
        try:
            importlib.import_module(package)
        except ImportError:
            raise FfkvError(f"reading {path.name} needs the {package} package: pip install 'ffkv[gguf]' "
                            "(gguf and accelerate)") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ffkv.memories.architectures import ARCHITECTURES, supported_families

    _check_whole(path)
    folder, file = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True,
                                            trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; the user needs one line
        raise FfkvError(f"cannot read {str(path)!r} as a GGUF model ({_first_line(exc)})") from None
    arch = next((a for a in ARCHITECTURES if config.model_type in a.model_types and not a.encoder), None)
    if arch is None:
        raise FfkvError(f"unsupported architecture {config.model_type!r} in {str(path)!r}; ffkv supports: "
                        f"{supported_families()}")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype, local_files_only=True,
                                                     trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True,
                                                  trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001
        raise FfkvError(f"cannot load the model in {str(path)!r} ({_first_line(exc)})") from None
    return model, HFTokenizer(tokenizer, vocab_size=model.get_output_embeddings().weight.shape[0])


def _check_whole(path: Path) -> None:
    """Read the file's header, metadata and tensor table with gguf's own reader before transformers does: counts
    and lengths beyond the file (a damaged or crafted file) are named as such, not as transformers' fallback
    error ("not a valid JSON file")."""
    import gguf

    try:
        gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises many types; the user needs one line
        raise FfkvError(f"{str(path)!r} is not a readable GGUF file: gguf's reader fails on its header, metadata "
                        f"or tensor table ({path.stat().st_size:,} bytes; {_first_line(exc)})") from None


def _first_line(exc: Exception) -> str:
    """An exception as one line: its type and the start of its message's first line."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


@register_loader
def _load(name: str, dtype: torch.dtype, device: str) -> tuple[nn.Module, Tokenizer] | None:
    return load_gguf(name, dtype) if is_gguf(name) else None


__all__ = ["is_gguf", "load_gguf"]

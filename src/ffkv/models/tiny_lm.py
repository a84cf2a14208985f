"""ffkv's own small language model (``ffkv_lm``) and its loader, including the embedded ``ffkv-tiny``.

The shape is the paper's model in miniature (Baevski & Auli 2019): a decoder-only
transformer of pre-norm blocks with ReLU feed-forward layers
``FF(x) = ReLU(x·Kᵀ + b_K)·V + b_V`` and learned (or sinusoidal) positions. It
is a Hugging Face `PreTrainedModel` (saved with ``save_pretrained`` as
safetensors), laid out like GPT-Neo so the memory-view table entry is the
GPT-style one::

    transformer.wte, transformer.wpe, transformer.h[i].{ln_1, attn, ln_2,
    mlp.c_fc, mlp.act, mlp.c_proj}, transformer.ln_f, lm_head (tied to wte)

Its tokenizer is a byte-level BPE trained with the ``tokenizers`` package
(`train_tokenizer`), stored as ``tokenizer.json`` beside the weights; ``encode``
puts ``<s>`` first. The loader claims the name ``ffkv-tiny`` (the checkpoint in
``ffkv/assets/ffkv-tiny``) and any directory whose ``config.json`` says
``"model_type": "ffkv_lm"``.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ffkv.errors import FfkvError
from ffkv.models.attention import causal_attention
from ffkv.models.loading import register_loader
from ffkv.models.tokenizer import HFTokenizer
from ffkv.store import untrusted

MODEL_TYPE = "ffkv_lm"
TINY_NAME = "ffkv-tiny"
#: Special tokens, in id order: padding, begin of example, end of example, unknown.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def sinusoidal_table(n_positions: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal positions (Vaswani et al.): sin on the first half of the dims, cos on the second."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    angles = torch.arange(n_positions, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(n_positions, 1)], dim=1)
    return table


def _attention_mask(attention_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """Boolean (batch, 1, t, t) mask: causal and not a padded key; None when nothing is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None  # plain causal attention (right padding never reaches a real token anyway)
    keys = attention_mask.bool()[:, None, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal & keys
    # A padded query (left padding) would see no key at all: let it see itself, so no NaN appears.
    return mask | torch.eye(t, dtype=torch.bool, device=attention_mask.device)


# The model classes subclass transformers' PreTrainedModel, whose import takes seconds; they
# are defined on first use (module __getattr__), so `import ffkv.models` stays light. The configuration
# is defined (and registered with AutoConfig) on its own: `ffkv.hf_auto` registers it while transformers'
# auto modules are still being imported, before the model classes can be.
_CONFIG = ("FfkvLMConfig",)
_CLASSES = ("FfkvSelfAttention", "FfkvMLP", "FfkvBlock", "FfkvLMPreTrainedModel", "FfkvLMModel", "FfkvLMForCausalLM")


def _define_config() -> dict:
    from transformers import AutoConfig, PretrainedConfig

    class FfkvLMConfig(PretrainedConfig):
        """Configuration of an ``ffkv_lm`` model.

        Args:
            vocab_size: |V|.
            hidden_size: d, the width of the residual stream.
            num_layers: L.
            num_heads: attention heads (hidden_size must be divisible by it).
            intermediate_size: d_m, memories per FF layer.
            max_position_embeddings: longest sequence.
            positions: ``learned`` or ``sinusoidal`` (fixed, not trained).
            dropout: dropout on embeddings, attention output and FF output (training only).
            layer_norm_eps: LayerNorm epsilon.
            initializer_range: std of the normal initialisation.
        """

        model_type = MODEL_TYPE

        def __init__(
            self,
            vocab_size: int = 4096,
            hidden_size: int = 256,
            num_layers: int = 6,
            num_heads: int = 4,
            intermediate_size: int = 1024,
            max_position_embeddings: int = 128,
            positions: str = "learned",
            dropout: float = 0.1,
            layer_norm_eps: float = 1e-5,
            initializer_range: float = 0.02,
            tie_word_embeddings: bool = True,
            pad_token_id: int = PAD_ID,
            bos_token_id: int = BOS_ID,
            eos_token_id: int = EOS_ID,
            **kwargs,
        ) -> None:
            if positions not in ("learned", "sinusoidal"):
                raise FfkvError(f"unknown positions {positions!r}; choose learned or sinusoidal")
            if hidden_size % num_heads:
                raise FfkvError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
            self.vocab_size = vocab_size
            self.hidden_size = hidden_size
            self.num_layers = num_layers
            self.num_heads = num_heads
            self.intermediate_size = intermediate_size
            self.max_position_embeddings = max_position_embeddings
            self.positions = positions
            self.dropout = dropout
            self.layer_norm_eps = layer_norm_eps
            self.initializer_range = initializer_range
            super().__init__(
                pad_token_id=pad_token_id,
                bos_token_id=bos_token_id,
                eos_token_id=eos_token_id,
                tie_word_embeddings=tie_word_embeddings,
                **kwargs,
            )

        @property
        def num_hidden_layers(self) -> int:
            return self.num_layers

    AutoConfig.register(MODEL_TYPE, FfkvLMConfig, exist_ok=True)
    return _named({"FfkvLMConfig": FfkvLMConfig})


def _named(defined: dict) -> dict:
    """Give classes defined inside a function this module's names (as if defined at its top level)."""
    for name, cls in defined.items():
        cls.__qualname__ = name
        cls.__module__ = __name__
    return defined


def _define_classes() -> dict:
    """The model's classes, defined on first use (transformers is imported then): its layers, then the models."""
    layers = _define_layers(__getattr__("FfkvLMConfig"))
    return _named({**layers, **_define_models(__getattr__("FfkvLMConfig"), layers["FfkvBlock"])})


def _define_layers(FfkvLMConfig: type) -> dict:
    """Attention, the FF layer (keys c_fc, values c_proj) and the pre-norm block: plain torch modules."""

    class FfkvSelfAttention(nn.Module):
        """Causal multi-head self-attention (scaled dot product), padding-aware."""

        def __init__(self, config: FfkvLMConfig) -> None:
            super().__init__()
            d = config.hidden_size
            self.num_heads = config.num_heads
            self.q_proj = nn.Linear(d, d)
            self.k_proj = nn.Linear(d, d)
            self.v_proj = nn.Linear(d, d)
            self.out_proj = nn.Linear(d, d)
            self.dropout = nn.Dropout(config.dropout)

        def forward(self, hidden_states: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
            out = causal_attention(hidden_states, self.q_proj, self.k_proj, self.v_proj, self.num_heads, attn_mask)
            return self.dropout(self.out_proj(out))

    class FfkvMLP(nn.Module):
        """The FF layer as key-value memories: c_fc rows are keys, c_proj columns are values."""

        def __init__(self, config: FfkvLMConfig) -> None:
            super().__init__()
            self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
            self.act = nn.ReLU()
            self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
            self.dropout = nn.Dropout(config.dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.c_proj(self.act(self.c_fc(x))))

    class FfkvBlock(nn.Module):
        """Pre-norm block: h = h + attn(ln_1(h)); h = h + mlp(ln_2(h))."""

        def __init__(self, config: FfkvLMConfig) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.attn = FfkvSelfAttention(config)
            self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.mlp = FfkvMLP(config)

        def forward(self, hidden_states: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
            hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attn_mask)
            return hidden_states + self.mlp(self.ln_2(hidden_states))

    return {"FfkvSelfAttention": FfkvSelfAttention, "FfkvMLP": FfkvMLP, "FfkvBlock": FfkvBlock}


def _define_models(FfkvLMConfig: type, FfkvBlock: type) -> dict:
    """The transformers models: the blocks with embeddings (`FfkvLMModel`) and with the tied LM head
    (`FfkvLMForCausalLM`, registered with `AutoModelForCausalLM`)."""
    from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

    class FfkvLMPreTrainedModel(PreTrainedModel):
        config_class = FfkvLMConfig
        base_model_prefix = "transformer"
        _no_split_modules = ["FfkvBlock"]
        _supports_sdpa = True

        def _init_weights(self, module: nn.Module) -> None:
            super()._init_weights(module)
            if isinstance(module, FfkvLMModel) and module.config.positions == "sinusoidal":
                with torch.no_grad():
                    module.wpe.weight.copy_(sinusoidal_table(*module.wpe.weight.shape))

    class FfkvLMModel(FfkvLMPreTrainedModel):
        """The blocks without the LM head: ``forward(input_ids, attention_mask)`` -> last hidden state (after ln_f)."""

        def __init__(self, config: FfkvLMConfig) -> None:
            super().__init__(config)
            self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
            self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.positions == "sinusoidal":
                self.wpe.weight.requires_grad_(False)
            self.drop = nn.Dropout(config.dropout)
            self.h = nn.ModuleList(FfkvBlock(config) for _ in range(config.num_layers))
            self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.post_init()

        def get_input_embeddings(self) -> nn.Embedding:
            return self.wte

        def set_input_embeddings(self, value: nn.Embedding) -> None:
            self.wte = value

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            **kwargs,
        ) -> BaseModelOutput:
            """Hidden states of a batch.

            Args:
                input_ids: (batch, pos) token ids.
                attention_mask: (batch, pos), 1 for real tokens and 0 for padding (right
                    padding is the norm; left padding also works: positions count real tokens).
            """
            b, t = input_ids.shape
            if t > self.config.max_position_embeddings:
                raise FfkvError(
                    f"sequence of {t} tokens is longer than this model's {self.config.max_position_embeddings} positions"
                )
            if attention_mask is not None and not bool(attention_mask.all()):
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                positions = torch.arange(t, device=input_ids.device)[None, :].expand(b, t)
            hidden = self.drop(self.wte(input_ids) + self.wpe(positions))
            mask = _attention_mask(attention_mask, t)
            for block in self.h:
                hidden = block(hidden, mask)
            return BaseModelOutput(last_hidden_state=self.ln_f(hidden))

    class FfkvLMForCausalLM(FfkvLMPreTrainedModel, GenerationMixin):
        """ffkv_lm with its (tied) LM head; ``labels`` gives the mean next-token cross-entropy. ``generate``
        works as for any causal LM, without a key-value cache (each step reads the whole prefix again)."""

        _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

        def __init__(self, config: FfkvLMConfig) -> None:
            super().__init__(config)
            self.transformer = FfkvLMModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_input_embeddings(self) -> nn.Embedding:
            return self.transformer.wte

        def set_input_embeddings(self, value: nn.Embedding) -> None:
            self.transformer.wte = value

        def get_output_embeddings(self) -> nn.Linear:
            return self.lm_head

        def set_output_embeddings(self, value: nn.Linear) -> None:
            self.lm_head = value

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            labels: torch.Tensor | None = None,
            **kwargs,
        ) -> CausalLMOutput:
            """Logits (batch, pos, |V|); with ``labels`` (same shape, -100 = ignore), the shifted LM loss."""
            hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = self.lm_head(hidden)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
                )
            return CausalLMOutput(loss=loss, logits=logits)

    AutoModelForCausalLM.register(FfkvLMConfig, FfkvLMForCausalLM, exist_ok=True)
    return {"FfkvLMPreTrainedModel": FfkvLMPreTrainedModel, "FfkvLMModel": FfkvLMModel,
            "FfkvLMForCausalLM": FfkvLMForCausalLM}


def __getattr__(name: str):
    if name in _CONFIG or name in _CLASSES:
        if name not in globals():
            globals().update(_define_config() if name in _CONFIG else _define_classes())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ tokenizer
def train_tokenizer(lines: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on `lines`, deterministic.

    Ids 0-3 are ``<pad> <s> </s> <unk>``; encoding adds ``<s>`` first.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(lines), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def save_tokenizer(tok, directory: str | Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that `AutoTokenizer` understands."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_prefix_space": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def hf_tokenizer(directory: str | Path):
    """The `PreTrainedTokenizerFast` of an ffkv_lm directory."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(Path(directory) / "tokenizer.json"),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------- loader
@contextmanager
def quiet_transformers():
    """Hide transformers' own progress bars while saving or loading (ffkv shows its own)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def tiny_path() -> Path:
    """Directory of the embedded ``ffkv-tiny`` checkpoint (inside the installed package)."""
    from importlib.resources import files

    return Path(str(files("ffkv") / "assets" / TINY_NAME))


def tiny_transcoders_path() -> Path:
    """Directory of the transcoders shipped for ``ffkv-tiny`` (sparsify's layout, one folder per layer;
    written by ``ffkv train-dictionary``: see its README there)."""
    from importlib.resources import files

    return Path(str(files("ffkv") / "assets" / f"{TINY_NAME}-transcoders"))


def is_ffkv_lm_dir(path: Path) -> bool:
    """Whether `path` holds an ffkv_lm model: its ``config.json`` (a regular file of at most 1 MiB, read as one
    someone else made: `ffkv.store.untrusted`) names ffkv_lm's model type."""
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        data = untrusted.read_json_object(config, 1 << 20, "a model's config")
    except FfkvError:
        return False
    return data.get("model_type") == MODEL_TYPE


def load_dir(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, HFTokenizer]:
    """Load an ffkv_lm directory (config.json, model.safetensors, tokenizer.json) in eval mode."""
    directory = Path(directory)
    model_class = __getattr__("FfkvLMForCausalLM")
    try:
        with quiet_transformers():
            model = model_class.from_pretrained(directory, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - one clear line for the user
        raise FfkvError(f"cannot load ffkv_lm model from {str(directory)!r}: {exc}".splitlines()[0]) from None
    if not (directory / "tokenizer.json").is_file():
        raise FfkvError(f"{str(directory)!r} has no tokenizer.json; an ffkv_lm directory needs one")
    return model.eval(), HFTokenizer(hf_tokenizer(directory), vocab_size=model.config.vocab_size)


@register_loader
def _load_ffkv_lm(name: str, dtype: torch.dtype, device: str):
    if name == TINY_NAME:
        path = tiny_path()
        if not (path / "config.json").is_file():
            raise FfkvError(f"the embedded model {TINY_NAME!r} is missing from this installation ({path})")
        return load_dir(path, dtype)
    path = Path(name)
    if path.is_dir() and is_ffkv_lm_dir(path):
        return load_dir(path, dtype)
    return None

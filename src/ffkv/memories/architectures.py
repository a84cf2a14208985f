"""Where each architecture keeps its feed-forward memories: the one per-family table.

Every other part of ffkv reaches a model's keys, values, norms and unembedding
through an `Architecture` entry found here, so supporting a new family means
adding one entry (docs/definitions.md). Getters take the loaded model (or one of its
blocks) and return modules; nothing here runs a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ffkv.errors import FfkvError

Getter = Callable[[nn.Module], nn.Module]


@dataclass(frozen=True)
class Architecture:
    """How to find the feed-forward memories of one model family.

    Attributes:
        family: readable family name (shown in errors and manifests).
        model_types: the `config.model_type` values this entry serves.
        blocks: model -> the list of transformer blocks, bottom to top.
        key_proj: block -> the linear layer whose rows are the keys k_i
            (the gate projection for gated FF layers).
        down_proj: block -> the second FF matrix; its input is the coefficient vector m.
        up_proj: block -> the non-gate input projection u_i of gated FF layers, else None.
        activation: (model, block) -> the FF nonlinearity f.
        resid_mid_site: block -> (module, argument index) whose forward input is
            resid_mid; None for parallel blocks, where resid_mid = resid_pre + attn_out.
        attention: block -> attention module (used for parallel blocks only).
        parallel: model -> whether attention and FF read the same block input.
        final_norm: model -> callable N applied before the unembedding (identity if None).
        unembed: model -> the linear map to vocabulary logits (weight |V| x d).
        base: model -> the module that runs the blocks without the LM head.
        conv1d: weights stored as (in, out), as in GPT-2's Conv1D.
        encoder: masked-LM encoder (bidirectional attention) rather than a causal LM.
        embed: model -> the input token embedding (its output is what causal tracing corrupts).
    """

    family: str
    model_types: tuple[str, ...]
    blocks: Callable[[nn.Module], Sequence[nn.Module]]
    key_proj: Getter
    down_proj: Getter
    activation: Callable[[nn.Module, nn.Module], Callable[[torch.Tensor], torch.Tensor]]
    resid_mid_site: Callable[[nn.Module], tuple[nn.Module, int] | None]
    attention: Getter
    final_norm: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None]
    unembed: Getter
    base: Getter
    up_proj: Callable[[nn.Module], nn.Module | None] = lambda block: None
    parallel: Callable[[nn.Module], bool] = lambda model: False
    conv1d: bool = False
    encoder: bool = False
    embed: Getter = lambda model: model.get_input_embeddings()
    notes: str = field(default="", compare=False)


def _opt_final_norm(model: nn.Module):
    decoder = model.model.decoder
    norm = decoder.final_layer_norm
    project_out = decoder.project_out
    if norm is None and project_out is None:
        return None

    def apply(h: torch.Tensor) -> torch.Tensor:
        if norm is not None:
            h = norm(h)
        if project_out is not None:
            h = project_out(h)
        return h

    return apply


def _opt_resid_mid_site(block: nn.Module):
    # Pre-norm OPT feeds resid_mid to final_layer_norm; post-norm OPT (350m) feeds it to fc1.
    if block.do_layer_norm_before:
        return block.final_layer_norm, 0
    return block.fc1, 0


def _bert_final_norm(model: nn.Module):
    return model.cls.predictions.transform


def _roberta_final_norm(model: nn.Module):
    head = model.lm_head

    def apply(h: torch.Tensor) -> torch.Tensor:
        return head.layer_norm(nn.functional.gelu(head.dense(h)))

    return apply


def _gpt_style(family: str, model_types: tuple[str, ...], conv1d: bool) -> Architecture:
    return Architecture(
        family=family,
        model_types=model_types,
        blocks=lambda m: m.transformer.h,
        key_proj=lambda b: b.mlp.c_fc,
        down_proj=lambda b: b.mlp.c_proj,
        activation=lambda m, b: b.mlp.act,
        resid_mid_site=lambda b: (b.ln_2, 0),
        attention=lambda b: b.attn,
        final_norm=lambda m: m.transformer.ln_f,
        unembed=lambda m: m.lm_head,
        base=lambda m: m.transformer,
        conv1d=conv1d,
    )


def _gated(family: str, model_types: tuple[str, ...]) -> Architecture:
    return Architecture(
        family=family,
        model_types=model_types,
        blocks=lambda m: m.model.layers,
        key_proj=lambda b: b.mlp.gate_proj,
        up_proj=lambda b: b.mlp.up_proj,
        down_proj=lambda b: b.mlp.down_proj,
        activation=lambda m, b: b.mlp.act_fn,
        resid_mid_site=lambda b: (b.post_attention_layernorm, 0),
        attention=lambda b: b.self_attn,
        final_norm=lambda m: m.model.norm,
        unembed=lambda m: m.lm_head,
        base=lambda m: m.model,
    )


def _encoder(family: str, model_types: tuple[str, ...], prefix: str, final_norm) -> Architecture:
    return Architecture(
        family=family,
        model_types=model_types,
        blocks=lambda m: getattr(m, prefix).encoder.layer,
        key_proj=lambda b: b.intermediate.dense,
        down_proj=lambda b: b.output.dense,
        activation=lambda m, b: b.intermediate.intermediate_act_fn,
        # BertOutput.forward(hidden_states, input_tensor): input_tensor is the attention output.
        resid_mid_site=lambda b: (b.output, 1),
        attention=lambda b: b.attention,
        final_norm=final_norm,
        unembed=lambda m: m.get_output_embeddings(),
        base=lambda m: getattr(m, prefix),
        encoder=True,
        notes="post-norm: resid_post is resid_mid + ff_out before the block's LayerNorm",
    )


ARCHITECTURES: tuple[Architecture, ...] = (
    _gpt_style("GPT-2", ("gpt2",), conv1d=True),
    _gpt_style("GPT-Neo", ("gpt_neo",), conv1d=False),
    Architecture(
        family="GPT-NeoX",
        model_types=("gpt_neox",),
        blocks=lambda m: m.gpt_neox.layers,
        key_proj=lambda b: b.mlp.dense_h_to_4h,
        down_proj=lambda b: b.mlp.dense_4h_to_h,
        activation=lambda m, b: b.mlp.act,
        resid_mid_site=lambda b: None if b.use_parallel_residual else (b.post_attention_layernorm, 0),
        attention=lambda b: b.attention,
        parallel=lambda m: bool(m.config.use_parallel_residual),
        final_norm=lambda m: m.gpt_neox.final_layer_norm,
        unembed=lambda m: m.get_output_embeddings(),
        base=lambda m: m.gpt_neox,
    ),
    Architecture(
        family="GPT-J",
        model_types=("gptj",),
        blocks=lambda m: m.transformer.h,
        key_proj=lambda b: b.mlp.fc_in,
        down_proj=lambda b: b.mlp.fc_out,
        activation=lambda m, b: b.mlp.act,
        resid_mid_site=lambda b: None,
        attention=lambda b: b.attn,
        parallel=lambda m: True,
        final_norm=lambda m: m.transformer.ln_f,
        unembed=lambda m: m.lm_head,
        base=lambda m: m.transformer,
    ),
    Architecture(
        family="OPT",
        model_types=("opt",),
        blocks=lambda m: m.model.decoder.layers,
        key_proj=lambda b: b.fc1,
        down_proj=lambda b: b.fc2,
        activation=lambda m, b: b.activation_fn,
        resid_mid_site=_opt_resid_mid_site,
        attention=lambda b: b.self_attn,
        final_norm=_opt_final_norm,
        unembed=lambda m: m.lm_head,
        base=lambda m: m.model,
    ),
    _gated("Llama-style gated (Llama, Mistral, Qwen2)", ("llama", "mistral", "qwen2")),
    _encoder("BERT", ("bert",), "bert", _bert_final_norm),
    _encoder("RoBERTa", ("roberta",), "roberta", _roberta_final_norm),
    _gpt_style("ffkv LM (ffkv-tiny)", ("ffkv_lm",), conv1d=False),
    Architecture(
        family="fairseq transformer_lm (the paper's model)",
        model_types=("fairseq_transformer_lm",),
        blocks=lambda m: m.decoder.layers,
        key_proj=lambda b: b.fc1,
        down_proj=lambda b: b.fc2,
        activation=lambda m, b: b.activation_fn,
        # Pre-norm feeds resid_mid to final_layer_norm; post-norm feeds the normed residual to fc1.
        resid_mid_site=lambda b: (b.final_layer_norm, 0) if b.normalize_before else (b.fc1, 0),
        attention=lambda b: b.self_attn,
        final_norm=lambda m: m.decoder.layer_norm,
        unembed=lambda m: m.decoder.output_layer,
        base=lambda m: m.decoder,
        embed=lambda m: m.decoder.embed_tokens,
        notes="adaptive softmax: the unembedding's call gives exact log-probabilities; "
        "its weight is the effective (|V|, d) matrix (see ffkv.models.fairseq_lm)",
    ),
)


#: Inputs at which `signed_coefficients` evaluates a non-gated activation: every smooth activation in use
#: (GELU and its approximations, SiLU, quick GELU, Mish, leaky ReLU, ...) is negative somewhere in it.
_PROBE = torch.linspace(-20.0, 20.0, 8001)


def signed_coefficients(arch: Architecture, model: nn.Module, block: nn.Module) -> bool:
    """Whether a block's coefficients m_i can be negative: the one rule behind `ffkv index --sign`'s default.

    A gated FF layer computes m = f(x·Gᵀ) ⊙ (x·Uᵀ): the up projection is signed, so m is signed
    whatever f is. Otherwise m = f(x·Kᵀ + b_K), signed exactly when f takes a negative value; f is
    evaluated on a grid of inputs from -20 to 20 (ReLU: never negative; GELU, SiLU: negative below 0).
    """
    if arch.up_proj(block) is not None:
        return True
    f = arch.activation(model, block)
    with torch.no_grad():
        return bool((f(_PROBE.to(arch.key_proj(block).weight.device)) < 0).any())


def supported_families() -> str:
    """The supported families, as one readable line."""
    return ", ".join(a.family for a in ARCHITECTURES)


def architecture_of(model: nn.Module) -> Architecture:
    """The table entry for a loaded model, or a clear error naming the supported families."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    raise FfkvError(
        f"unsupported architecture {model_type or type(model).__name__!r}; "
        f"ffkv supports: {supported_families()}"
    )

"""Projecting vectors onto the vocabulary: p(h) = softmax(N(h)·Eᵀ) (docs/definitions.md).

N is the identity (the paper's choice, and the default for values and memory
sub-updates) or the model's final normalization (the default for residual-stream
vectors, the "logit lens"). Every result records which one it used. A third projection,
"translator", inserts a fitted per-layer affine map before N (the tuned lens,
`ffkv.memories.translators`): N(A_l·h + b_l) for a residual-stream vector of layer l,
N(A_l·u) for an update written into it (a value, a sub-update, the FF output); with
A_l = I, b_l = 0 it is the final-norm projection. It needs the view's fitted translators.

`scan_values` is the one chunked projection of a layer's values: every per-value
statistic of ffkv (the values experiment, the explorer's lookup tables) comes from it.
Memory (the paper's script needed ~150 GB for this step): values are projected `chunk`
keys at a time, with chunk x |V| x 4 bytes <= `CHUNK_BYTES` (256 MiB). At most three such
buffers are alive at once (logits, probabilities, the rank comparison and softmax
temporaries), so the working memory is about 3 x CHUNK_BYTES = 0.75 GiB whatever L, d_m
and |V| are. For the paper's model (16 x 4,096 memories, |V| = 267,744, d = 1,024) that is
250 keys per chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import numpy as np
import torch
from jaxtyping import Float, Int

from ffkv.allocator import release
from ffkv.errors import FfkvError
from ffkv.memories.view import MemoryView

if TYPE_CHECKING:
    from ffkv.memories.sets import MemorySet

PROJECTIONS = ("identity", "final-norm")
#: The fitted per-layer projection (needs `MemoryView.translators`); not one of the residual choices above.
TRANSLATOR = "translator"
#: Defaults of docs/definitions.md: values and sub-updates as in the paper, residuals through N.
DEFAULT_FOR_VALUES = "identity"
DEFAULT_FOR_RESIDUALS = "final-norm"
#: A distribution over the vocabulary whose entropy is above this share of the maximum, log|V|, reads as uniform.
UNIFORM_ENTROPY_SHARE = 0.99
CHUNK_BYTES = 256 * 2**20
TOP_TOKENS = 10


def reading_projection(view: MemoryView) -> str:
    """The projection under which the model itself reads what a layer adds to the residual stream: its final norm
    where it has one (every vector reaches the unembedding through it), else the identity. The explorer reads a
    value this way first; the paper's figures keep `DEFAULT_FOR_VALUES`."""
    return "final-norm" if view.arch.final_norm(view.model) is not None else "identity"


def entropy_share(z: Float[torch.Tensor, "vocab"]) -> float:
    """The entropy of softmax(z) as a share of the maximum, log|V|: 1 for the uniform distribution; above
    `UNIFORM_ENTROPY_SHARE` a distribution reads as uniform (nothing in it stands out)."""
    logp = torch.log_softmax(z.double(), -1)
    return float(-(logp.exp() * logp).sum() / math.log(z.numel())) if z.numel() > 1 else 0.0


def check_projection(name: str) -> str:
    """Validate a projection name."""
    if name not in PROJECTIONS and name != TRANSLATOR:
        raise FfkvError(f"unknown projection {name!r}; choose from {', '.join(PROJECTIONS)}")
    return name


@torch.no_grad()
def logits(view: MemoryView, h: Float[torch.Tensor, "*batch d_model"],
           projection: str, layer: int | None = None, update: bool = False) -> Float[torch.Tensor, "*batch vocab"]:
    """Vocabulary logits of vectors h: N(h)·Eᵀ, float32.

    As in docs/definitions.md, the LM head's bias (GPT-J, BERT) is not added: it is the
    same for every vector and would pull every distribution towards frequent tokens.
    Heads that are not one matrix (fairseq's adaptive softmax) are called as they are.

    Args:
        layer, update: for the "translator" projection only: the layer whose translator maps h, and
            whether h is an update (value, sub-update, FF output: A_l·h, no bias) rather than a
            residual-stream vector (A_l·h + b_l).
    """
    check_projection(projection)
    if projection == TRANSLATOR:
        if view.translators is None or layer is None:
            raise FfkvError("the translator projection needs fitted translators (`ffkv analyze --only translators`)"
                            " and a layer")
        h = view.translators.apply(layer, h, bias=not update)
    return unembed_logits(view, h, normalize=projection != "identity")


@torch.no_grad()
def final_logits(view: MemoryView, head_in: Float[torch.Tensor, "*batch d_model"] | None,
                 resid_post_last: Float[torch.Tensor, "*batch d_model"]) -> Float[torch.Tensor, "*batch vocab"]:
    """The model's own output logits from one captured forward pass, float32: its LM head applied to the captured
    ``head_in`` (bias included), or, for a model whose forward does not call its head as a module, the logit lens
    of the last layer's output with the head's bias. Every reader of a model's prediction asks here."""
    if head_in is not None:
        return view.final_logits(head_in)
    z = unembed_logits(view, resid_post_last, normalize=True)
    if view.unembedding_bias is not None:
        z = z + view.unembedding_bias.float()
    return z


def unembed_logits(view: MemoryView, h: Float[torch.Tensor, "*batch d_model"],
                   normalize: bool) -> Float[torch.Tensor, "*batch vocab"]:
    """N(h)·Eᵀ (N the final normalization when `normalize`, else the identity), float32, head bias left out;
    differentiable in h (the translators are fitted through it)."""
    if normalize:
        h = view.final_norm(h)
    head = view.arch.unembed(view.model)
    h = h.to(view.unembedding.dtype)
    if isinstance(head, torch.nn.Linear):
        return (h @ head.weight.T).float()
    return head(h).float()


def chunk_size(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Keys per chunk so that one chunk of float32 logits takes at most `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


@torch.no_grad()
def top_tokens(view: MemoryView, layer: int, keys: Int[np.ndarray, "n"] | None, n: int,
               projection: str = DEFAULT_FOR_VALUES, sign: int = 1, chunk: int | None = None,
               memories: "MemorySet | None" = None) -> tuple[Int[np.ndarray, "n top"], Float[np.ndarray, "n top"]]:
    """The n tokens each value v_i of `keys` (None: every key of the layer) puts highest, best first: the one
    owner of "a value's top tokens" (concepts, the explorer's memory page, the interventions' own token set).

    Args:
        sign: -1 reads -v_i: what a memory with a negative coefficient writes (its bottom tokens).
        memories: whose values (`ffkv.memories.sets`): default the model's neurons; a dictionary's `Latents`
            reads its decoder rows.

    Returns:
        (len(keys), n) token ids and their logits N(±v_i)·Eᵀ (float32), `chunk` values at a time.
    """
    values = (memories or view).values(layer)
    if keys is not None:
        values = values[torch.as_tensor(np.asarray(keys), dtype=torch.long, device=values.device)]
    chunk = chunk or chunk_size(view.vocab_size)
    ids, top = [], []
    for start in range(0, values.shape[0], chunk):
        part = values[start:start + chunk]
        z = logits(view, part if sign > 0 else -part, projection, layer=layer, update=True)
        best = torch.topk(z, min(n, z.shape[-1]), dim=-1)
        ids.append(_numpy(best.indices))
        top.append(_numpy(best.values))
    if not ids:
        return np.zeros((0, n), dtype=np.int64), np.zeros((0, n), dtype=np.float32)
    return np.concatenate(ids).astype(np.int64), np.concatenate(top)


@torch.no_grad()
def scan_values(view: MemoryView, layer: int, projection: str, targets: Int[np.ndarray, "n"],
                chunk: int | None = None, top: int = TOP_TOKENS, sign: int = 1,
                keys: Int[np.ndarray, "n"] | None = None, memories: "MemorySet | None" = None
                ) -> dict[str, np.ndarray]:
    """Per-key statistics of p_i = softmax(N(v_i)·Eᵀ) for one layer, `chunk` keys at a time.

    Args:
        targets: token id per key whose rank and probability are wanted; -1 for none.
        sign: -1 projects -v_i instead: what a memory with a negative coefficient writes (docs/definitions.md).
        keys: the values to read, as key indices (repeats allowed: the control memories borrow values,
            `ffkv.memories.controls`); None: every key of the layer, in order.
        memories: whose values (`ffkv.memories.sets`): default the model's neurons; a dictionary's `Latents`
            reads its decoder rows.

    Returns arrays of length d_m (or len(keys)): top_token_id, bottom_token_id (argmin: what a negative
    coefficient promotes, docs/definitions.md), top_prob, entropy, logsumexp, target_rank
    (1 = the value's top token; ties count in the target's favour), target_prob, and
    (d_m, top) top_token_ids / top_probs.
    """
    values = (memories or view).values(layer)
    if keys is not None:
        values = values[torch.as_tensor(np.asarray(keys), dtype=torch.long, device=values.device)]
    d_m = values.shape[0]
    chunk = chunk or chunk_size(view.vocab_size)
    device = values.device
    targets_t = torch.as_tensor(np.asarray(targets), dtype=torch.long, device=device)
    # Each chunk's results are copied into arrays allocated once and its temporaries all freed before the next
    # chunk: results (and temporaries) kept from one chunk to the next pin the heap between the chunks' |V|-wide
    # blocks, which then take new memory each time, memory that `ffkv`'s allocator setting (`ffkv.allocator`)
    # never hands back (a dictionary of 24,576 latents grew the process by 9 GB a layer that way).
    out: dict[str, torch.Tensor] = {}
    for start in range(0, d_m, chunk):
        end = min(start + chunk, d_m)
        part = _scan_chunk(view, values[start:end] if sign > 0 else -values[start:end], layer, projection,
                           targets_t[start:end], top)
        for name, value in part.items():
            if name not in out:
                out[name] = torch.empty((d_m, *value.shape[1:]), dtype=value.dtype, device=value.device)
            out[name][start:end] = value
        del part
    release()  # the chunks' |V|-wide temporaries, freed: not pinned apart by the next layer's (`ffkv.allocator`)
    return {k: _numpy(v) for k, v in out.items()}


def _scan_chunk(view: MemoryView, values: torch.Tensor, layer: int, projection: str, t: torch.Tensor, top: int
                ) -> dict[str, torch.Tensor]:
    """`scan_values`' statistics of one chunk of values (`t`: their target tokens, -1 for none)."""
    z = logits(view, values, projection, layer=layer, update=True)  # (n, |V|) float32
    lse = torch.logsumexp(z, dim=-1)
    top_logits, top_ids = torch.topk(z, min(top, z.shape[1]), dim=-1)
    has = t >= 0
    t_logit = z.gather(1, t.clamp(min=0)[:, None])
    rank = (z > t_logit).sum(dim=-1) + 1
    # Entropy H = lse - sum p·z, with p built in place over z's own buffer.
    pz = (z - lse[:, None]).exp_().mul_(z).sum(dim=-1)
    return {"top_token_id": top_ids[:, 0], "bottom_token_id": z.argmin(dim=-1),
            "top_prob": (top_logits[:, 0] - lse).exp(),
            "entropy": lse - pz, "logsumexp": lse, "target_rank": torch.where(has, rank, torch.full_like(rank, -1)),
            "target_prob": torch.where(has, (t_logit[:, 0] - lse).exp(), torch.full_like(lse, float("nan"))),
            "top_token_ids": top_ids, "top_probs": (top_logits - lse[:, None]).exp()}

"""The paper's model format: fairseq ``transformer_lm`` checkpoints, run natively with PyTorch alone.

Geva et al. analysed ``transformer_lm.wiki103.adaptive`` (Baevski & Auli 2019):
16 pre-norm decoder layers, d=1024, d_m=4096, ReLU, sinusoidal positions,
adaptive input and adaptive softmax (cutoffs 20000, 60000; factor 4; tied
weights and projections), vocabulary 267,744. A directory holding fairseq's
``model.pt`` (``{"args" | "cfg": ..., "model": state_dict}``) and ``dict.txt``
loads here without fairseq; plain (non-adaptive) ``transformer_lm`` checkpoints
load too.

Layout (names follow fairseq, so the state dict loads as it is)::

    decoder.embed_tokens            AdaptiveInput (.embeddings.{band}.0 / .1) or nn.Embedding
    decoder.layers[i].self_attn     q_proj, k_proj, v_proj, out_proj (old in_proj_* is split)
    decoder.layers[i].self_attn_layer_norm, fc1, fc2, final_layer_norm
    decoder.layer_norm              only when the checkpoint has one (wiki103: none)
    decoder.output_layer            `AdaptiveSoftmaxHead` or nn.Linear: the unembedding

Semantics checked against fairseq's ``TransformerDecoder``: token embeddings are
scaled by sqrt(d) (unless ``no_scale_embedding``), fairseq's sinusoidal table
(sin half then cos half, row ``padding_idx`` zero) is indexed at
``padding_idx + 1 + i`` for the i-th real token, pre-norm blocks
``x + attn(LN(x))`` then ``x + fc2(relu(fc1(LN(x))))`` (post-norm when
``decoder_normalize_before`` is false).

Unembedding. ``output_layer(h)`` returns exact log-probabilities over the whole
vocabulary from the adaptive softmax (head: log_softmax over the cutoff[0]
frequent words and one class logit per tail band; tail band b: log_softmax of its
own logits plus the band's class log-probability). ``output_layer.weight`` is
the effective (|V|, d) linear map E: head rows are the head word matrix (composed
with the head's input projection if it has one); tail rows of band b are
``O_b · P_b``, the band's output matrix composed with its d→d_b projection. With
tied adaptive weights these are exactly the adaptive-input embeddings of the
words. ``E·h`` gives each word's logit within its band (the quantity the softmax
normalises); use the module call for probabilities.

Tokenization. WikiText is already Moses-tokenized (space-separated, ``@-@``,
``@,@``, ``@.@`` escapes), so each whitespace token is looked up in ``dict.txt``
(fairseq's four specials first: ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3;
unknown words map to ``<unk>``). A token missing from the dictionary is split
Moses-style (punctuation, WikiText's ``@-@`` escapes for hyphens and number
separators, clitics) and its pieces looked up, so untokenized text also works
while WikiText text is left untouched. As in fairseq's language-modelling data
(``TokenBlockDataset`` with targets), the first input token is ``</s>`` (eos),
standing for the end of the previous sentence: ``encode`` prepends it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ffkv.errors import FfkvError
from ffkv.models.attention import causal_attention
from ffkv.models.loading import register_loader
from ffkv.models.safe_load import load_checkpoint, plain
from ffkv.models.token_display import TokenDisplay

MODEL_TYPE = "fairseq_transformer_lm"
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = 0, 1, 2, 3


# ------------------------------------------------------------------- config
@dataclass
class FairseqLMConfig:
    """What the checkpoint's args say (or the ``transformer_lm_wiki103`` defaults where it is silent)."""

    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int = 8
    ffn_dim: int = 4096
    normalize_before: bool = True
    activation: str = "relu"
    scale_embedding: bool = True
    padding_idx: int = PAD
    max_positions: int = 3072
    adaptive_input_cutoff: list[int] = field(default_factory=list)  # band boundaries incl. vocab_size
    adaptive_input_dims: list[int] = field(default_factory=list)  # embedding width of each band
    adaptive_softmax_cutoff: list[int] = field(default_factory=list)
    tie_adaptive_proj: bool | None = None
    final_norm: bool = False
    model_type: str = MODEL_TYPE

    @property
    def hidden_size(self) -> int:
        return self.embed_dim

    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers


def _activation(name: str) -> nn.Module:
    acts = {"relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_fast": nn.GELU(approximate="tanh"),
            "gelu_accurate": nn.GELU(approximate="tanh"), "tanh": nn.Tanh(), "linear": nn.Identity()}
    if name not in acts:
        raise FfkvError(f"fairseq activation {name!r} is not supported; supported: {', '.join(acts)}")
    return acts[name]


# ------------------------------------------------------------------- modules
def sinusoidal_positions(num_embeddings: int, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's SinusoidalPositionalEmbedding table (sin half, cos half; row padding_idx zero)."""
    half = dim // 2
    scale = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -scale)
    angles = torch.arange(num_embeddings, dtype=torch.float)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_embeddings, 1)], dim=1)
    table[padding_idx] = 0
    return table


class AdaptiveInput(nn.Module):
    """fairseq's adaptive input: band b embeds its words in d/factor^b dims, projected to d."""

    def __init__(self, cutoff: list[int], dims: list[int], output_dim: int, padding_idx: int) -> None:
        super().__init__()
        self.cutoff = list(cutoff)
        self.embedding_dim = output_dim
        self.embeddings = nn.ModuleList()
        prev = 0
        for end, dim in zip(self.cutoff, dims):
            self.embeddings.append(nn.Sequential(nn.Embedding(end - prev, dim, padding_idx), nn.Linear(dim, output_dim, bias=False)))
            prev = end

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embeddings[0][1].weight
        out = torch.zeros(*input_ids.shape, self.embedding_dim, dtype=weight.dtype, device=weight.device)
        prev = 0
        for band, end in zip(self.embeddings, self.cutoff):
            mask = (input_ids >= prev) & (input_ids < end)
            if mask.any():
                out[mask] = band(input_ids[mask] - prev)
            prev = end
        return out


class _Matrix(nn.Module):
    """A bias-free linear map whose weight is stored (out, in), or (in, out) when `transpose`."""

    def __init__(self, rows: int, cols: int, transpose: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.transpose = transpose

    def matrix(self) -> torch.Tensor:
        """As (out_features, in_features)."""
        return self.weight.T if self.transpose else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.matrix())


class AdaptiveSoftmaxHead(nn.Module):
    """Exact full-vocabulary log-probabilities of fairseq's adaptive softmax; `weight` is the effective E.

    Parameters, as in the checkpoint (``decoder.adaptive_softmax.*``):
    ``head.word_proj`` (cutoff[0] words; with an optional ``head.word_proj.0``
    input projection when tied to a narrower band-0 embedding) and
    ``head.class_proj`` (one logit per tail band) when tied; ``head`` (one matrix,
    words then classes) when not; ``tail.{b}.0`` (d → d_b projection) and
    ``tail.{b}.2`` (d_b → band words).
    """

    def __init__(self, cutoff: list[int], head_shapes: dict, tail_shapes: list[tuple], tail_transposed: list[bool]) -> None:
        super().__init__()
        self.cutoff = list(cutoff)
        self.vocab_size = self.cutoff[-1]
        self.tied_head = "class_proj" in head_shapes
        if self.tied_head:
            self.head = nn.Module()
            if "word_in" in head_shapes:
                self.head.word_proj = nn.Sequential(_Matrix(*head_shapes["word_in"]), _Matrix(*head_shapes["word_proj"]))
            else:
                self.head.word_proj = _Matrix(*head_shapes["word_proj"])
            self.head.class_proj = _Matrix(*head_shapes["class_proj"])
        else:
            self.head = _Matrix(*head_shapes["head"])
        self.tail = nn.ModuleList(
            nn.Sequential(_Matrix(*proj, transpose=t), nn.Identity(), _Matrix(*out))
            for (proj, out), t in zip(tail_shapes, tail_transposed)
        )
        self._cache: tuple | None = None

    def _head_words(self) -> torch.Tensor:
        if not self.tied_head:
            return self.head.matrix()[: self.cutoff[0]]
        proj = self.head.word_proj
        if isinstance(proj, nn.Sequential):
            return proj[1].matrix() @ proj[0].matrix()
        return proj.matrix()

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tied_head:
            return self.head(x)
        return torch.cat([self.head.word_proj(x), self.head.class_proj(x)], dim=-1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (..., |V|) of hidden states h (..., d)."""
        head = torch.log_softmax(self._head_logits(h).float(), dim=-1)
        parts = [head[..., : self.cutoff[0]]]
        for b, tail in enumerate(self.tail):
            prior = head[..., self.cutoff[0] + b : self.cutoff[0] + b + 1]
            parts.append(torch.log_softmax(tail(h).float(), dim=-1) + prior)
        return torch.cat(parts, dim=-1).to(h.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Effective E (|V|, d): head word rows, then each tail band's O_b·P_b (cached per weight version)."""
        params = tuple(self.parameters())
        key = tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in params)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                rows = [self._head_words()]
                for tail in self.tail:
                    rows.append(tail[2].matrix() @ tail[0].matrix())
                self._cache = (key, torch.cat(rows, dim=0))
        return self._cache[1]


class SelfAttention(nn.Module):
    """fairseq MultiheadAttention (self, causal): q scaled by head_dim^-0.5."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise FfkvError(f"embed dim {dim} is not divisible by {heads} attention heads")
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(causal_attention(x, self.q_proj, self.k_proj, self.v_proj, self.num_heads, attn_mask))


class DecoderLayer(nn.Module):
    """fairseq TransformerDecoderLayer without encoder attention."""

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        d = config.embed_dim
        self.normalize_before = config.normalize_before
        self.self_attn = SelfAttention(d, config.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.ffn_dim)
        self.activation_fn = _activation(config.activation)
        self.fc2 = nn.Linear(config.ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.normalize_before:
            x = x + self.self_attn(self.self_attn_layer_norm(x), attn_mask)
            return x + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, attn_mask))
        return self.final_layer_norm(x + self.fc2(self.activation_fn(self.fc1(x))))


class _Output:
    def __init__(self, last_hidden_state: torch.Tensor) -> None:
        self.last_hidden_state = last_hidden_state

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.last_hidden_state,)[i]


class FairseqDecoder(nn.Module):
    """The blocks: ``forward(input_ids, attention_mask)`` -> features before the output layer."""

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        d = config.embed_dim
        self.config = config
        self.padding_idx = config.padding_idx
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        if config.adaptive_input_cutoff:
            self.embed_tokens = AdaptiveInput(config.adaptive_input_cutoff, config.adaptive_input_dims, d, config.padding_idx)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, d, config.padding_idx)
        self.register_buffer(
            "positions", sinusoidal_positions(config.max_positions + config.padding_idx + 1, d, config.padding_idx),
            persistent=False,
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.layer_norm = nn.LayerNorm(d) if config.final_norm else None
        self.output_layer: nn.Module = nn.Identity()  # set by the loader

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> _Output:
        b, t = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        # fairseq make_positions: padding_idx + 1 + (number of real tokens so far); padding -> padding_idx.
        positions = torch.cumsum(mask, dim=1) * mask + self.padding_idx
        if int(positions.max()) >= self.positions.shape[0]:
            # fairseq's sinusoidal table grows on demand; so does this one.
            self.positions = sinusoidal_positions(int(positions.max()) + 1, self.positions.shape[1], self.padding_idx).to(
                device=self.positions.device, dtype=self.positions.dtype)
        x = self.embed_scale * self.embed_tokens(input_ids) + self.positions[positions].to(self.positions.dtype)
        attn_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            attn_mask = (causal & attention_mask.bool()[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
        for layer in self.layers:
            x = layer(x, attn_mask)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return _Output(x)


class FairseqTransformerLM(nn.Module):
    """A fairseq transformer_lm: ``decoder`` (blocks) and ``decoder.output_layer`` (unembedding).

    ``forward(input_ids, attention_mask)`` returns an object with ``logits``: log-probabilities
    for adaptive-softmax models, plain logits otherwise (both rank and normalise alike).
    """

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = FairseqDecoder(config)

    def get_output_embeddings(self) -> nn.Module:
        return self.decoder.output_layer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        h = self.decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        out = _Output(h)
        out.logits = self.decoder.output_layer(h)
        return out


# ---------------------------------------------------------------- dictionary
class FairseqDictTokenizer:
    """fairseq ``dict.txt`` vocabulary behind ffkv's `Tokenizer` contract (see the module doc)."""

    def __init__(self, symbols: Sequence[str], moses: bool = True) -> None:
        self.symbols = list(symbols)
        self.index = {}
        for i, s in enumerate(self.symbols):
            self.index.setdefault(s, i)
        self.moses = moses
        self._display: TokenDisplay | None = None

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int | None = None, moses: bool = True) -> "FairseqDictTokenizer":
        symbols = list(SPECIALS)
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                word, _, rest = line.rpartition(" ")
                if rest == "#fairseq:overwrite":
                    word = word.rpartition(" ")[0]
                if not word:
                    raise FfkvError(f"bad line in {str(path)!r}: {line[:60]!r} (expected 'word count')")
                symbols.append(word)
        if vocab_size is not None:
            if vocab_size < len(symbols):
                raise FfkvError(f"{str(path)!r} has {len(symbols)} symbols but the model only {vocab_size} rows")
            # fairseq pads the dictionary to a multiple of 8 with made-up words.
            symbols += [f"madeupword{i:04d}" for i in range(vocab_size - len(symbols))]
        return cls(symbols, moses=moses)

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def pad_id(self) -> int:
        return PAD

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset({BOS, PAD, EOS})

    def words(self, text: str) -> list[str]:
        """Whitespace tokens; out-of-dictionary ones split Moses-style (WikiText conventions)."""
        out: list[str] = []
        for token in text.split():
            if token in self.index or not self.moses:
                out.append(token)
            else:
                out.extend(moses_split(token))
        return out

    def encode(self, text: str) -> list[int]:
        return [EOS] + [self.index.get(w, UNK) for w in self.words(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.symbols[int(i)] if 0 <= int(i) < len(self.symbols) else "<unk>" for i in ids)

    @property
    def display(self) -> TokenDisplay:
        """How the words read (`ffkv.models.token_display`): each one a word start, " the"."""
        if self._display is None:
            self._display = TokenDisplay.from_pieces(self.symbols, "word", self.special_ids)
        return self._display

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return self.display.vocabulary(ids)

    def sequence_strings(self, ids: Sequence[int]) -> list[str]:
        return self.display.sequence(ids)


_NUMBER_SEP = re.compile(r"(?<=\d)([,.])(?=\d)")
_HYPHEN = re.compile(r"(?<=\w)-(?=\w)")
_CLITIC = re.compile(r"(?i)^(.+?)(n't|'s|'re|'ve|'ll|'d|'m)$")
_PUNCT = re.compile(r"(@[-,.]@|[^\w@'\s]|'(?!\w))")


def moses_split(token: str) -> list[str]:
    """Moses-style pieces of one whitespace token, with WikiText's escapes.

    ``well-known`` -> ``well @-@ known``; ``1,000.5`` -> ``1 @,@ 000 @.@ 5``;
    ``(Paris),`` -> ``( Paris ) ,``; ``don't`` -> ``do n't``; ``John's`` -> ``John 's``.
    """
    token = _NUMBER_SEP.sub(lambda m: f" @{m.group(1)}@ ", token)
    token = _HYPHEN.sub(" @-@ ", token)
    pieces: list[str] = []
    for part in token.split():
        if re.fullmatch(r"@[-,.]@", part):
            pieces.append(part)
            continue
        for piece in _PUNCT.split(part):
            if not piece:
                continue
            m = _CLITIC.match(piece)
            pieces.extend([m.group(1), m.group(2)] if m else [piece])
    return pieces


# -------------------------------------------------------------------- loading
def _load_checkpoint(path: Path) -> dict:
    """A fairseq checkpoint's contents, read without running code from it (`ffkv.models.safe_load`): the
    paper's stores its settings as an argparse.Namespace, newer ones as an omegaconf config (read inert)."""
    ckpt = load_checkpoint(path, what="fairseq checkpoint")
    if not isinstance(ckpt, dict):
        raise FfkvError(f"{str(path)!r} is not a fairseq checkpoint: it holds a {type(ckpt).__name__}, not a dict")
    return ckpt


def _model_args(ckpt: dict) -> dict:
    """The model's hyperparameters as a plain dict, from 'args' (old) or 'cfg'['model'] (newer)."""
    args = plain(ckpt.get("args"))
    if isinstance(args, dict):
        return args
    cfg = plain(ckpt.get("cfg"))
    model = cfg.get("model") if isinstance(cfg, dict) else None
    return dict(model) if isinstance(model, dict) else {}


def _upgrade(state: dict) -> dict:
    """Rename older fairseq parameter names to the current ones (combined in_proj, layer_norms.N)."""
    out = {}
    for name, t in state.items():
        if name.startswith("decoder.version") or name.endswith("_float_tensor") or name.endswith(".version"):
            continue
        m = re.match(r"(decoder\.layers\.\d+)\.self_attn\.in_proj_(weight|bias)$", name)
        if m:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                out[f"{m.group(1)}.self_attn.{part}.{m.group(2)}"] = chunk
            continue
        m = re.match(r"(decoder\.layers\.\d+)\.layer_norms\.([01])\.(weight|bias)$", name)
        if m:
            which = "self_attn_layer_norm" if m.group(2) == "0" else "final_layer_norm"
            out[f"{m.group(1)}.{which}.{m.group(3)}"] = t
            continue
        out[name] = t
    return out


def _truthy(args: dict, key: str, default: bool) -> bool:
    value = args.get(key, default)
    return default if value is None else bool(value)


def build_model(ckpt: dict) -> FairseqTransformerLM:
    """A `FairseqTransformerLM` with the checkpoint's weights (state dict ``ckpt['model']``)."""
    if "model" not in ckpt or not isinstance(ckpt["model"], dict):
        raise FfkvError("not a fairseq checkpoint: no 'model' state dict")
    args = _model_args(ckpt)
    state = _upgrade(ckpt["model"])
    layer_ids = {int(m.group(1)) for k in state if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    if not layer_ids:
        raise FfkvError("not a fairseq transformer_lm checkpoint: no decoder.layers.* parameters")
    adaptive_input = any(k.startswith("decoder.embed_tokens.embeddings.") for k in state)
    if adaptive_input:
        bands = sorted({int(k.split(".")[3]) for k in state if k.startswith("decoder.embed_tokens.embeddings.")})
        sizes = [state[f"decoder.embed_tokens.embeddings.{b}.0.weight"].shape[0] for b in bands]
        input_cutoff = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        vocab_size = input_cutoff[-1]
        embed_dim = state["decoder.embed_tokens.embeddings.0.1.weight"].shape[0]
        dims = [state[f"decoder.embed_tokens.embeddings.{b}.0.weight"].shape[1] for b in bands]
    else:
        input_cutoff, dims = [], []
        vocab_size, embed_dim = state["decoder.embed_tokens.weight"].shape
    first = state["decoder.layers.0.fc1.weight"]
    config = FairseqLMConfig(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=max(layer_ids) + 1,
        num_heads=int(args.get("decoder_attention_heads") or 8),
        ffn_dim=first.shape[0],
        normalize_before=_truthy(args, "decoder_normalize_before", True),
        activation=str(args.get("activation_fn") or "relu"),
        scale_embedding=not _truthy(args, "no_scale_embedding", False),
        max_positions=int(args.get("max_target_positions") or args.get("tokens_per_sample") or 3072),
        adaptive_input_cutoff=input_cutoff,
        adaptive_input_dims=dims,
        final_norm="decoder.layer_norm.weight" in state,
    )
    model = FairseqTransformerLM(config)

    # Output layer.
    softmax_keys = {k[len("decoder.adaptive_softmax."):]: v for k, v in state.items() if k.startswith("decoder.adaptive_softmax.")}
    for k in list(state):
        if k.startswith("decoder.adaptive_softmax.") or k == "decoder.output_projection.weight":
            state.pop(k)
    if softmax_keys:
        head_shapes: dict = {}
        if "head.class_proj.weight" in softmax_keys:
            head_shapes["class_proj"] = tuple(softmax_keys["head.class_proj.weight"].shape)
            if "head.word_proj.weight" in softmax_keys:
                head_shapes["word_proj"] = tuple(softmax_keys["head.word_proj.weight"].shape)
            else:
                head_shapes["word_in"] = tuple(softmax_keys["head.word_proj.0.weight"].shape)
                head_shapes["word_proj"] = tuple(softmax_keys["head.word_proj.1.weight"].shape)
            n_tail = head_shapes["class_proj"][0]
            head_words = head_shapes["word_proj"][0]
        else:
            head_shapes["head"] = tuple(softmax_keys["head.weight"].shape)
            n_tail = len({k.split(".")[1] for k in softmax_keys if k.startswith("tail.")})
            head_words = head_shapes["head"][0] - n_tail
        tail_shapes, transposed, cutoff = [], [], [head_words]
        tie_proj = args.get("tie_adaptive_proj")
        for b in range(n_tail):
            proj = tuple(softmax_keys[f"tail.{b}.0.weight"].shape)
            out = tuple(softmax_keys[f"tail.{b}.2.weight"].shape)
            # nn.Linear(d -> d_b) stores (d_b, d); a tied projection is the adaptive input's
            # (d, d_b) matrix used transposed. Square shapes are told apart by the args.
            if proj == (out[1], embed_dim) and proj != (embed_dim, out[1]):
                t = False
            elif proj == (embed_dim, out[1]) and proj != (out[1], embed_dim):
                t = True
            elif proj == (embed_dim, embed_dim):
                t = bool(tie_proj)
            else:
                raise FfkvError(f"adaptive softmax tail {b} projection has unexpected shape {proj}")
            tail_shapes.append((proj, out))
            transposed.append(t)
            cutoff.append(cutoff[-1] + out[0])
        if cutoff[-1] != vocab_size:
            raise FfkvError(f"adaptive softmax covers {cutoff[-1]} words but the vocabulary has {vocab_size}")
        head = AdaptiveSoftmaxHead(cutoff, head_shapes, tail_shapes, transposed)
        head_state = {k: v for k, v in softmax_keys.items() if k != "version"}
        missing, unexpected = head.load_state_dict(head_state, strict=False)
        if missing or unexpected:
            raise FfkvError(f"adaptive softmax parameters do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.decoder.output_layer = head
        config.adaptive_softmax_cutoff = cutoff
        config.tie_adaptive_proj = None if tie_proj is None else bool(tie_proj)
    else:
        linear = nn.Linear(embed_dim, vocab_size, bias=False)
        weight = ckpt["model"].get("decoder.output_projection.weight", ckpt["model"].get("decoder.embed_out"))
        if weight is None:  # share_decoder_input_output_embed
            weight = state["decoder.embed_tokens.weight"]
        if weight.shape == (embed_dim, vocab_size):  # very old fairseq stored embed_out as (d, V)
            weight = weight.T
        linear.weight = nn.Parameter(weight.clone())
        model.decoder.output_layer = linear
    state.pop("decoder.embed_out", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("decoder.output_layer.")]
    if missing or unexpected:
        raise FfkvError(
            f"fairseq checkpoint does not match a transformer_lm: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if softmax_keys:
        _tie_to_adaptive_input(model)
    return model.eval()


def _tie_to_adaptive_input(model: FairseqTransformerLM) -> None:
    """Share the softmax parameters that fairseq tied to the adaptive input (one copy in memory).

    Tied only where the checkpoint's two tensors are equal, so an untied checkpoint stays untied.
    """
    head = model.decoder.output_layer
    embed = model.decoder.embed_tokens
    if not isinstance(embed, AdaptiveInput):
        return
    pairs = []
    if head.tied_head and not isinstance(head.head.word_proj, nn.Sequential):
        pairs.append((head.head.word_proj, embed.embeddings[0][0]))
    for b, tail in enumerate(head.tail, start=1):
        if b < len(embed.embeddings):
            pairs.append((tail[2], embed.embeddings[b][0]))
            if tail[0].transpose:
                pairs.append((tail[0], embed.embeddings[b][1]))
    for module, source in pairs:
        if module.weight.shape == source.weight.shape and torch.equal(module.weight, source.weight):
            module.weight = source.weight


def is_fairseq_dir(path: Path) -> bool:
    return path.is_dir() and (path / "model.pt").is_file() and (path / "dict.txt").is_file()


def load_fairseq_dir(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[FairseqTransformerLM, FairseqDictTokenizer]:
    """Load ``model.pt`` + ``dict.txt`` from a directory (the paper's model layout)."""
    directory = Path(directory)
    model = build_model(_load_checkpoint(directory / "model.pt"))
    tokenizer = FairseqDictTokenizer.from_file(directory / "dict.txt", vocab_size=model.config.vocab_size)
    return model.to(dtype).eval(), tokenizer


@register_loader
def _load_fairseq(name: str, dtype: torch.dtype, device: str):
    path = Path(name)
    if not is_fairseq_dir(path):
        return None
    return load_fairseq_dir(path, dtype)

"""Fitted per-layer translators: where the shared vocabulary space holds (docs/definitions.md; the tuned lens,
Belrose et al. 2023).

For each layer l an affine map T_l(h) = A_l·h + b_l, initialised at A_l = I, b_l = 0, is fitted on the
residual vectors resid_mid[l] of training examples (every position) to minimise

    KL(p_final || softmax(N(A_l·h + b_l)·Eᵀ)),

p_final the model's own output distribution at the position (its LM head, bias included) and N the
model's final normalization, applied *after* the translator as in the tuned lens (so the identity
translator is the logit lens, the final-norm projection). The head's bias is left out of the
translated distribution as of every projection (docs/definitions.md).

Memory and time are bounded whatever the corpus: the training examples are streamed in minibatches
(`fit_translators`); of a minibatch only its residuals (L x n x d) and the head's input (n x d) are
held, and its logits are made `chunk` positions at a time (chunk x |V| x 4 bytes <= the projection's
chunk budget), each chunk's gradient taken at once, so at most one chunk's graph is alive. The
optimizer is Adam on the summed per-layer losses (the layers' parameters are independent).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from jaxtyping import Float

from ffkv.errors import FfkvError
from ffkv.store.atomic import write_with

#: Where a run directory keeps its fitted translators (`ffkv analyze --only translators`).
RUN_FILE = Path("translators") / "translators.npz"

#: Default optimisation settings (`fit_translators`): at least `EPOCHS` passes and at least `MIN_STEPS` optimizer
#: steps (a small training set is passed over more often), Adam at `LEARNING_RATE`.
EPOCHS = 4
MIN_STEPS = 100
LEARNING_RATE = 1e-2


@dataclass
class Translators:
    """Per-layer affine maps T_l(h) = A_l·h + b_l (float32).

    Attributes:
        weight: (L, d, d) A_l.
        bias: (L, d) b_l.
        info: what they were fitted on and how (examples, positions, epochs, losses).
    """

    weight: Float[torch.Tensor, "layers d d"]
    bias: Float[torch.Tensor, "layers d"]
    info: dict = field(default_factory=dict)

    @classmethod
    def identity(cls, n_layers: int, d_model: int, device: torch.device | str = "cpu") -> "Translators":
        """A_l = I, b_l = 0 for every layer (the logit lens)."""
        return cls(torch.eye(d_model, device=device).repeat(n_layers, 1, 1), torch.zeros(n_layers, d_model,
                                                                                            device=device))

    @property
    def n_layers(self) -> int:
        return int(self.weight.shape[0])

    def apply(self, layer: int, h: Float[torch.Tensor, "*batch d"], bias: bool = True) -> torch.Tensor:
        """A_l·h (+ b_l when `bias`), in h's dtype."""
        if not 0 <= layer < self.n_layers:
            raise FfkvError(f"layer {layer} out of range: the translators have {self.n_layers} layers")
        a = self.weight[layer].to(h.device)
        out = h.float() @ a.T
        if bias:
            out = out + self.bias[layer].to(h.device)
        return out.to(h.dtype)

    def to(self, device: torch.device | str) -> "Translators":
        return Translators(self.weight.to(device), self.bias.to(device), dict(self.info))

    def save(self, path: str | Path) -> Path:
        """Write weight, bias and info (JSON) to one .npz file, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, weight=self.weight.detach().cpu().numpy(), bias=self.bias.detach().cpu().numpy(),
                 info=np.array(json.dumps(self.info)))
        write_with(path, lambda f: f.write(buffer.getvalue()))
        return path

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> "Translators":
        with np.load(Path(path), allow_pickle=False) as data:
            return cls(torch.from_numpy(data["weight"]).to(device), torch.from_numpy(data["bias"]).to(device),
                       json.loads(str(data["info"])))


#: One minibatch of the stream: per-layer residual vectors (L, n, d) and the n positions' final logits,
#: given as a function of a slice of positions (so that no more than a chunk of logits is ever made).
Minibatch = tuple[torch.Tensor, Callable[[slice], torch.Tensor]]


def kl_rows(target_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) per row, in nats (float32)."""
    logp = torch.log_softmax(target_logits.float(), -1)
    logq = torch.log_softmax(logits.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def fit_translators(stream: Callable[[], Iterable[Minibatch]], lens: Callable[[torch.Tensor], torch.Tensor],
                    n_layers: int, d_model: int, chunk: int, epochs: int = EPOCHS, lr: float = LEARNING_RATE,
                    device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
                    ) -> Translators:
    """Fit every layer's translator on a stream of minibatches.

    Args:
        stream: called once per epoch; yields (residuals (L, n, d), final_logits(slice) -> (k, |V|)).
        lens: x -> N(x)·Eᵀ for translated vectors x, differentiable.
        chunk: positions whose logits are made at once.
        epochs, lr: passes over the stream, and Adam's learning rate.
        progress: called with the number of positions after each minibatch.

    Returns the translators with info: epochs, lr, n_positions (per epoch), steps and the mean training
    KL per layer of the last epoch (`train_kl`).
    """
    if epochs < 1 or chunk < 1:
        raise FfkvError("fit_translators needs epochs >= 1 and chunk >= 1")
    weight = torch.eye(d_model, device=device).repeat(n_layers, 1, 1).requires_grad_(True)
    bias = torch.zeros(n_layers, d_model, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=lr)
    steps, n_positions, last_kl = 0, 0, np.zeros(n_layers)
    for epoch in range(epochs):
        total, count = np.zeros(n_layers), 0
        for resid, final_logits in stream():
            n = int(resid.shape[1])
            if n == 0:
                continue
            grad_w, grad_b = torch.zeros_like(weight), torch.zeros_like(bias)
            for start in range(0, n, chunk):
                part = slice(start, min(n, start + chunk))
                with torch.no_grad():
                    logp = torch.log_softmax(final_logits(part).float(), -1)
                    p = logp.exp()
                for layer in range(n_layers):
                    x = resid[layer, part].float() @ weight[layer].T + bias[layer]
                    logq = torch.log_softmax(lens(x).float(), -1)
                    kl = (p * (logp - logq)).sum(-1)
                    gw, gb = torch.autograd.grad(kl.sum() / n, [weight, bias])
                    grad_w += gw
                    grad_b += gb
                    total[layer] += float(kl.detach().sum())
                    del x, logq, kl
            weight.grad, bias.grad = grad_w, grad_b
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            count += n
            if progress is not None:
                progress(n)
        if epoch == 0:
            n_positions = count
        last_kl = total / max(count, 1)
    info = {"epochs": epochs, "lr": lr, "optimizer": "Adam", "n_positions": n_positions, "steps": steps,
            "train_kl_last_epoch": [float(v) for v in last_kl],
            "objective": "KL(p_final || softmax(N(A_l h + b_l) E^T)), mean over training positions",
            "init": "A_l = I, b_l = 0"}
    return Translators(weight.detach(), bias.detach(), info)


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% normal interval (1.96 standard errors); nan bounds for n < 2."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if len(x) < 2:
        return m, math.nan, math.nan
    half = 1.96 * float(x.std(ddof=1)) / math.sqrt(len(x))
    return m, m - half, m + half


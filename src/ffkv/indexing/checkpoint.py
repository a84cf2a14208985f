"""The checkpoint of an unfinished index (RUN/.partial/checkpoint.pt) and what it means.

It holds the running top-k state after whole batches, how far the corpus was read
(`consumed` examples, whole windows), how many batches of the next window are already
in the state, and the batching that cut those windows and batches. That batching is
part of its meaning: under another batch size the same counts would name other
examples. So it is stored with the checkpoint, and a resume under a different one is
refused with one line naming the option (`Checkpoint.check_cutting`); options that do
not cut batches (checkpoint interval, part size, tokenizer processes) may change freely.
Every entry is then checked against what this run writes (`Checkpoint.template`: the
states' shapes and dtypes, counts that are counts) before anything merges into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ffkv.errors import FfkvError
from ffkv.indexing.topk import TopKState
from ffkv.models.checkpoint_schema import Omittable, check, count, number, tensor
from ffkv.models.safe_load import load_checkpoint
from ffkv.store import atomic

#: What cuts the corpus into windows and padded batches, and the option that sets each.
CUTTING = {"batch_size": "--batch-size", "max_batch_tokens": "--max-batch-tokens",
           "window_batches": "window_batches (BatchOptions)", "pad_multiple": "pad_multiple (BatchOptions)",
           "device": "--device"}


@dataclass
class Checkpoint:
    """Where an index stands: its state and how far it read.

    Attributes:
        state: the running top-k of every key.
        consumed: examples read in whole windows.
        n_tokens: tokens run through the model.
        n_parts: example parts written to RUN/.partial (later ones are stale).
        groups_done: batches of the window after `consumed` already in `state`.
        windows: windows done.
        elapsed: seconds of indexing so far.
        n_cut: examples indexed so far that were cut to the maximum length (`ffkv.corpus.Example.cut`).
        cutting: the batching that cut windows and batches (`CUTTING`, device type included).
        control: the running top-k of the random control memories (`ffkv.memories.controls`), or None.
        latents: per FF layer a dictionary covers, the running top-k of its latents (`ffkv.memories.latent_keys`),
            or None (no dictionary).
        latent_control: per such layer, the running top-k of its control latents, or None.
    """

    state: TopKState
    cutting: dict[str, Any]
    control: TopKState | None = None
    latents: dict[int, TopKState] | None = None
    latent_control: dict[int, TopKState] | None = None
    consumed: int = 0
    n_tokens: int = 0
    n_parts: int = 0
    groups_done: int = 0
    windows: int = 0
    elapsed: float = 0.0
    n_cut: int = 0
    saved: bool = field(default=False, compare=False)

    def save(self, path: Path) -> None:
        """Write it atomically (a full disk raises OSError)."""
        data = {"state": self.state.state_dict(), "cutting": dict(self.cutting), "consumed": self.consumed,
                "n_tokens": self.n_tokens, "n_parts": self.n_parts, "groups_done": self.groups_done,
                "windows": self.windows, "elapsed": self.elapsed, "n_cut": self.n_cut}
        if self.control is not None:
            data["control"] = self.control.state_dict()
        for name in ("latents", "latent_control"):
            states = getattr(self, name)
            if states is not None:
                data[name] = {int(layer): state.state_dict() for layer, state in states.items()}
        atomic.write_with(path, lambda handle: torch.save(data, handle))
        self.saved = True

    @classmethod
    def load(cls, path: Path, device: torch.device, like: "Checkpoint | None" = None) -> "Checkpoint":
        """The checkpoint at `path`, its tensors on `device`. With `like`, the empty checkpoint of the run that
        resumes it (its tensors on the meta device will do: only their shapes and dtypes are read), it is refused
        in one line unless it was cut as that run cuts (`check_cutting`), holds the same states (control, the
        dictionary's layers) and every entry is one this run writes (`template`), before anything merges into it."""
        try:
            data = load_checkpoint(path, map_location=device, what="index checkpoint")
        except FfkvError as error:  # a file that names code to run, or not a checkpoint at all
            raise type(error)(f"{error}; choose a new --out") from None
        try:
            cutting = data.get("cutting")
            if cutting is None:
                raise FfkvError(f"the checkpoint {path} was written by an older ffkv and does not record the "
                                "batching it was cut with, so it cannot be resumed exactly; choose a new --out")
            control = TopKState.from_state_dict(data["control"]) if data.get("control") is not None else None
            by_layer = {name: None if data.get(name) is None else
                        {int(layer): TopKState.from_state_dict(s) for layer, s in data[name].items()}
                        for name in ("latents", "latent_control")}
            loaded = cls(state=TopKState.from_state_dict(data["state"]), cutting=dict(cutting), control=control,
                         **by_layer,
                         consumed=int(data["consumed"]), n_tokens=int(data["n_tokens"]), n_parts=int(data["n_parts"]),
                         groups_done=int(data["groups_done"]), windows=int(data["windows"]),
                         elapsed=float(data["elapsed"]), n_cut=int(data.get("n_cut", 0)), saved=True)
        except FfkvError:
            raise
        except Exception as error:  # a dict of other keys and types: not this checkpoint
            raise FfkvError(f"cannot read the checkpoint {path} ({type(error).__name__}); choose a new --out") from None
        if like is not None:
            loaded.check_cutting(like.cutting)
            if (loaded.control is None) != (like.control is None):
                raise FfkvError(f"the checkpoint {path} does not hold the control this run asks for "
                                "(--control-keys); choose a new --out")
            held, wanted = sorted(loaded.latents or {}), sorted(like.latents or {})
            if held != wanted:
                raise FfkvError(f"the checkpoint {path} holds the latents of layers {held or 'none'}, "
                                f"not of the dictionary this run asks for (--dictionary); choose a new --out")
            check(data, like.template(device), path, "choose a new --out")
        return loaded

    def template(self, device: torch.device | str) -> dict[str, Any]:
        """What a checkpoint of this run holds (`ffkv.models.checkpoint_schema`), from its empty checkpoint: each
        top-k state's four tensors of the empty one's shapes and dtypes, on `device` (scores as the model gave
        them, NaN and infinities included; example ids and positions 0 or more, next tokens -1 or more), the
        batching as this one's, counts, and a finite elapsed time (``n_cut`` is absent from older checkpoints)."""
        def state(s: TopKState) -> dict[str, Any]:
            return {"values": tensor(s.values, finite=False, device=device),
                    "example_id": tensor(s.example_id, minimum=0, device=device),
                    "position": tensor(s.position, minimum=0, device=device),
                    "next_token": tensor(s.next_token, minimum=-1, device=device)}
        template: dict[str, Any] = {
            "state": state(self.state), "cutting": dict(self.cutting), "consumed": count(), "n_tokens": count(),
            "n_parts": count(), "groups_done": count(), "windows": count(), "elapsed": number(minimum=0),
            "n_cut": Omittable(count())}
        if self.control is not None:
            template["control"] = state(self.control)
        for name in ("latents", "latent_control"):
            states = getattr(self, name)
            if states is not None:
                template[name] = {int(layer): state(s) for layer, s in states.items()}
        return template

    def check_cutting(self, cutting: dict[str, Any]) -> None:
        """Refuse to continue under a batching other than the one that made this checkpoint."""
        for name, option in CUTTING.items():
            then, now = self.cutting.get(name), cutting.get(name)
            if then != now:
                raise FfkvError(f"cannot resume with {option} {now}: the checkpoint was made with {option} {then}, "
                                "and another value would cut the corpus into other batches; resume with "
                                f"{option} {then}, or choose a new --out")


__all__ = ["CUTTING", "Checkpoint"]

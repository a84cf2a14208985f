"""The capture sink of the index's forward pass: the model's keys and their random-key control.

`ControlledReducer` feeds each layer's coefficients to the trigger reducer of the model's keys and,
from the same pass, the coefficients of the layer's random control memories
(`ffkv.memories.controls.RandomKeys`, computed from the captured FF input) to a second, small trigger
reducer of the same kind: the control costs one small product and one small reduction per layer, not
another pass over the corpus. Both follow the reducer protocol the index drives (`start`, the sink
call, `commit`, `flush`, `quantities`).
"""

from __future__ import annotations

import torch

from ffkv.batching import Batch
from ffkv.indexing.reducer import TriggerReducer
from ffkv.memories.controls import RandomKeys


class ControlledReducer:
    """Trigger reducers of the model's keys (`main`) and of its random control memories (`control`)."""

    #: What the forward pass must capture for this sink: coefficients, and the FF input for the control.
    quantities = ("coefficients", "ff_in")

    def __init__(self, main: TriggerReducer, control: TriggerReducer, keys: RandomKeys) -> None:
        self.main, self.control, self.keys = main, control, keys

    @property
    def state(self):
        return self.main.state

    def start(self, batch: Batch) -> None:
        self.main.start(batch)
        self.control.start(batch)

    def __call__(self, quantity: str, layer: int, tensor: torch.Tensor) -> None:
        if quantity == "coefficients":
            self.main(quantity, layer, tensor)
        else:  # ff_in: the control memories read the same input as the layer's keys
            self.control("coefficients", layer, self.keys.coefficients(layer, tensor))

    def commit(self) -> None:
        self.main.commit()
        self.control.commit()

    def flush(self) -> None:
        self.main.flush()
        self.control.flush()


__all__ = ["ControlledReducer"]

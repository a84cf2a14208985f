"""The trigger target: the token a key's value should predict, one definition for every part of ffkv.

For a causal LM (docs/definitions.md) it is the next token of the trigger prefix, -1 when
the prefix is the whole example. For a masked-LM encoder (docs/definitions.md) the model
predicts the token at the (masked) trigger position itself, so the target is the token
at the trigger position.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int


def trigger_targets(next_token_ids: Int[np.ndarray, "n"], position_token_ids: Int[np.ndarray, "n"],
                    encoder: bool) -> Int[np.ndarray, "n"]:
    """Per trigger entry, the token its key's value should predict (int64; -1 for none).

    Args:
        next_token_ids: the entries' `next_token_id` (-1 at the end of an example).
        position_token_ids: the token at each entry's trigger position.
        encoder: the model is a masked-LM encoder (BERT, RoBERTa).
    """
    chosen = position_token_ids if encoder else next_token_ids
    return np.asarray(chosen, dtype=np.int64)


TARGET_DESCRIPTION = {
    False: "next token of the key's top-1 trigger example",
    True: "token at the trigger position (masked-LM encoder)",
}

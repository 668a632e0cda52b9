"""The marks the optional rooms leave on a model, read by the other rooms (skip on a first read).

The decoder (llama.py) computes the same function whatever is marked here and reads none of
these attributes: a room that swaps a model's layers or head records what it did, so that the
rooms loaded after it (and the engine's checks, bench.py) can ask. Each is a class-level default
that the room overwrites on the one instance it changed:

    quantization   fast/int8.py ("int8") and fast/int4.py ("int4", a draft only) once they have
                   swapped the linear layers for quantized ones
    cpu_matmul     fast/cpu_linear.py and fast/row_invariant.py: which CPU variant of nn.Linear
                   the layers run ("linear", "weight_major", "prepacked", "row_invariant", ...)
    row_invariant  fast/row_invariant.py: every row is computed alike whatever the batch
    vocab_ids      drafters/reduced_vocab.py: a draft's reduced vocabulary, the target id of
                   each logit column ([N] int64), or None for the full vocabulary

Each room's docstring says why its output stays exact (or, for int8 / int4, what it changes).
"""

from __future__ import annotations

import torch


class ModelFeatures:
    """Class-level defaults of the marks above: a plain model, as built or loaded."""

    quantization: str | None = None
    cpu_matmul: str | None = None
    row_invariant: bool = False
    vocab_ids: torch.Tensor | None = None

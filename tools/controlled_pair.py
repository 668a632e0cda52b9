"""A target-draft pair whose acceptance is set by one number, epsilon: the check that the step model's
prediction (tools/step_model.py) holds end to end.

The draft is a small model. The target is that model's layers, then `extra` more decoder layers
whose contributions to the residual stream are scaled by epsilon (each extra layer's o_proj and
down_proj weights, the two matmuls that write into the stream, multiplied by epsilon), then the
small model's final norm and head:

    x_L = the small model's residual stream after its L layers
    x_{L+E} = x_L + epsilon * (what the E extra layers add)     logits = head(norm(x_{L+E}))

At epsilon 0 the target computes the draft's logits (x + 0 is x exactly), so greedy acceptance is 1
up to the rounding of k+1-row against 1-row forwards; as epsilon grows the extra layers move the
argmax and acceptance falls. The cost ratio is real: the target runs L + E layers, the draft L.
Epsilon changes the weights in place (`set_epsilon`), so the engines' CUDA graphs, which hold the
weights' addresses, stay valid across epsilons.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from random_models import random_transformer


@dataclass
class ControlledPair:
    draft: torch.nn.Module  # a minispec Transformer of L layers
    target: torch.nn.Module  # L + E layers, the first L and the embedding, norm and head the draft's
    scaled: list[tuple[torch.Tensor, torch.Tensor]]  # (an extra layer's o_proj / down_proj weight, its epsilon-1 value)
    epsilon: float = 1.0

    @torch.no_grad()
    def set_epsilon(self, epsilon: float) -> None:
        """Scale the extra layers' writes into the residual stream to epsilon times their drawn value."""
        if not epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        for weight, base in self.scaled:
            weight.copy_(base * epsilon)
        self.epsilon = epsilon


def build_pair(small: dict, extra: int, seed: int, device: torch.device, dtype: torch.dtype,
               max_positions: int = 4096) -> ControlledPair:
    """The draft (shape `small`, from `seed`) and a target with `extra` more layers (from seed + 1)
    sharing every weight of the draft; epsilon starts at 1."""
    if extra < 1:
        raise ValueError(f"the target needs at least one extra layer, got {extra}")
    draft = random_transformer(small, seed, device, dtype, max_positions)
    layers = small["num_hidden_layers"]
    target = random_transformer({**small, "num_hidden_layers": layers + extra}, seed + 1, device, dtype, max_positions)
    with torch.no_grad():
        own = target.state_dict()
        for name, tensor in draft.state_dict().items():  # (fused names: the two were built alike)
            own[name].copy_(tensor)
    scaled = []
    for layer in target.layers[layers:]:
        for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            scaled.append((weight.data, weight.detach().clone()))
    return ControlledPair(draft, target, scaled)

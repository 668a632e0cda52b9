"""SmoothQuant (Xiao et al. 2023, sec. 4): move activation outliers into the weights before int8.

A few input channels of a transformer's linear layers carry activations far larger than the rest
(SmolLM2-135M: the residual stream reaches ~25,000 in a few channels). With one activation scale
per row (int8.py), those channels set the scale and every other channel gets a handful of int8
levels. For a linear y = x W^T and any per-input-channel factor s > 0,

    y = (x / s) (W * s)^T        (W * s: column j of W times s_j)

is the same function, and when the division can be folded into the op that produces x, it costs
nothing at run time. With s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha) both x / s and W * s have
tamer ranges (alpha = 0.5, the paper's default). Folded here:
* q/k/v (fused qkv_proj) and gate/up (gate_up_proj): their input is an RMSNorm output, so the
  norm's weight is divided by s;
* down_proj: its input is silu(gate) * up, so up's rows are divided by s;
* lm_head: its input is the final norm's output (a tied head is untied first: the embedding is
  left as it is).
o_proj is left alone (its input is a mix of value rows shared by several query heads).
In exact arithmetic the model is unchanged; only the rounding of the later int8 step differs.
max|x_j| comes from one cache-free forward over calibration tokens (`CALIBRATION_TEXT`: a little
prose, code and a list, not the bench prompts).
How much it helps is measured by tools/quant_accuracy.py (figures in docs/int8.md).
"""

from __future__ import annotations

import torch

from torch import nn

from ..model.llama import Transformer
from .fusion import fuse_projections
from ..model.metadata import BatchMetadata

ALPHA = 0.5
CALIBRATION_TEXT = """The committee met on Tuesday to review the budget. After a long discussion, they agreed to
fund the new library, repair two bridges, and hire three teachers for the village school.

def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Shopping list: 2 kg of apples, milk, 12 eggs, olive oil, fresh basil.
Q: Why is the sky blue? A: Air molecules scatter short (blue) wavelengths of sunlight more strongly
than long (red) ones, so blue light reaches our eyes from every direction of the sky."""


@torch.inference_mode()
def input_maxima(model: Transformer, calibration: list[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of the smoothed layers, over the calibration sequences."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()  # [in]
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m
        return hook

    targets = {"lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        targets |= {f"{i}.qkv": layer.self_attn.qkv_proj, f"{i}.gate_up": layer.mlp.gate_up_proj,
                    f"{i}.down": layer.mlp.down_proj}
    handles = [module.register_forward_pre_hook(record(name)) for name, module in targets.items()]
    try:
        for ids in calibration:
            model(torch.tensor(ids, device=model.device), BatchMetadata.for_prompts([len(ids)], model.device))
    finally:
        for h in handles:
            h.remove()
    return maxima


def factors(x_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max_i |W_ij|^(1 - alpha), [in]."""
    w_max = weight.detach().float().abs().amax(0).clamp_min(1e-5)  # [in]
    return (x_max.clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp_min(1e-5)


def fold(norm_weight: torch.Tensor, linear: nn.Linear, x_max: torch.Tensor, alpha: float) -> None:
    """The norm's output (the linear's input) divided by s, the linear's columns multiplied by s."""
    s = factors(x_max, linear.weight, alpha)  # [in]
    norm_weight.div_(s.to(norm_weight.dtype))
    linear.weight.mul_(s.to(linear.weight.dtype))


@torch.no_grad()
def smooth(model: Transformer, calibration: list[list[int]], alpha: float = ALPHA) -> Transformer:
    """Fold SmoothQuant factors into `model` (in place; fp weights; returns it)."""
    if model.quantization is not None or not isinstance(model.lm_head, nn.Linear):
        raise ValueError("smooth() needs the full-precision model, before quantize_model")
    if not calibration or not all(len(ids) for ids in calibration):
        raise ValueError("smooth() needs at least one non-empty calibration sequence of token ids")
    fuse_projections(model)
    maxima = input_maxima(model, calibration)
    for i, layer in enumerate(model.layers):
        fold(layer.input_layernorm.weight, layer.self_attn.qkv_proj, maxima[f"{i}.qkv"], alpha)
        fold(layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj, maxima[f"{i}.gate_up"], alpha)
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        s = factors(maxima[f"{i}.down"], down.weight, alpha)
        up_rows = slice(down.in_features, 2 * down.in_features)  # up's rows in the fused weight
        gate_up.weight[up_rows].div_(s[:, None].to(gate_up.weight.dtype))
        if gate_up.bias is not None:
            gate_up.bias[up_rows].div_(s.to(gate_up.bias.dtype))
        down.weight.mul_(s.to(down.weight.dtype))
    head = model.lm_head
    if head.weight is model.embed_tokens.weight:  # tied: the head gets its own copy
        model.lm_head = head = nn.Linear(head.in_features, head.out_features, bias=False,
                                      device=head.weight.device, dtype=head.weight.dtype)
        head.weight.copy_(model.embed_tokens.weight)
    fold(model.norm.weight, head, maxima["lm_head"], alpha)
    return model

"""Fused projections: q/k/v in one matmul, gate/up in one matmul, and the state-dict plumbing
that goes with them (optional: skip on a first read of the model).

A checkpoint stores q_proj, k_proj and v_proj (and gate_proj, up_proj) as separate weights, and
the model in model/llama.py is built that way. The loaders fuse them: one `qkv_proj` whose weight
is the three stacked, [(Hq + 2 Hkv) D, in], and one `gate_up_proj`, [2 I, hidden]. On a CPU at
one to a few rows each matmul call costs far more than its arithmetic, so three calls become one.

Why the output stays exact. y = x W^T computes each output column c as the dot product of a row
of x with row c of W. Stacking the weights' rows stacks the outputs side by side, [q, k, v] or
[gate, up], and each column is still the same dot product of the same numbers: the fused model
computes the same function as the one it was built from, and `project` in llama.py splits the
fused output into the same q, k, v. (In floating point the library sums each column over the
input width; a matmul library may block that sum differently for a wider output, so fused and
unfused agree to rounding. Every loader fuses, so every loaded model computes one way.)

Loading. A loader builds the model on the meta device (no memory, no init), calls
`fuse_projections` to get the fused parameters' shapes, then `fused_state` turns a checkpoint's
state dict (HF names) into the fused one, writing each fused tensor part by part so the load
never holds a weight twice. `checkpoint_state_dict` is the inverse: a fused model's state dict
under the checkpoint's names (for saving, and for the shapes of a random model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..model.llama import MLP, Attention

PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear computing the given ones side by side: y = [y_1, y_2, ...] on the last axis."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device="meta")  # (no random init to overwrite)
    fused.weight = nn.Parameter(concat([p.weight.detach() for p in parts]))  # [sum(out), in]
    if first.bias is not None:
        fused.bias = nn.Parameter(concat([p.bias.detach() for p in parts]))  # [sum(out)]
    return fused


def concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat on the first axis; for a loader's meta skeleton, an empty meta tensor of that
    shape (torch.cat on the meta device imports torch's compiler stack, about a second)."""
    if not tensors[0].is_meta:
        return torch.cat(tensors)
    return torch.empty(sum(t.shape[0] for t in tensors), *tensors[0].shape[1:], dtype=tensors[0].dtype, device="meta")


def fuse_attention(attn: Attention) -> None:
    """q/k/v of one attention layer in one matmul (weight [(Hq + 2 Hkv) D, in]); once only."""
    if attn.qkv_proj is None:
        attn.qkv_proj = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj


def fuse_mlp(mlp: MLP) -> None:
    """gate and up of one MLP in one matmul (weight [2 I, hidden]); once only."""
    if mlp.gate_up_proj is None:
        mlp.gate_up_proj = fused_linear([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every layer in `model` (in place; returns it). Loaders do this
    after building the model under HF names; a fused model's state dict has the fused names."""
    for module in model.modules():
        if isinstance(module, Attention):
            fuse_attention(module)
        elif isinstance(module, MLP):
            fuse_mlp(module)
    return model


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() under checkpoint (HF) names: fused projections split back into
    q_proj / k_proj / v_proj and gate_proj / up_proj (views of the fused tensors)."""
    state = {}
    for name, tensor in model.state_dict().items():
        owner_name, _, leaf = name.rpartition(".")  # "layers.0.self_attn.qkv_proj", "weight"
        parent_name, _, kind = owner_name.rpartition(".")
        prefix = parent_name + "." if parent_name else ""
        if kind == "qkv_proj":
            pieces = tensor.split(model.get_submodule(parent_name).qkv_sizes)
        elif kind == "gate_up_proj":
            pieces = tensor.chunk(2)
        else:
            state[name] = tensor
            continue
        for part, value in zip(PARTS[kind], pieces):
            state[f"{prefix}{part}.{leaf}"] = value
    return state


def fused_state(model: nn.Module, state: dict[str, torch.Tensor],
                convert: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of a fused `model` from a checkpoint's (HF names), emptying `state` as it
    goes: each tensor is popped, passed through `convert` (cast, copy, move) and q/k/v or gate/up
    concatenated, so the caller never holds a tensor twice. The inverse of checkpoint_state_dict."""
    out = {}
    for name, like in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        parent, _, kind = owner.rpartition(".")
        if kind in PARTS:  # written part by part into one tensor: no intermediate copies
            pieces = [state.pop(f"{parent}.{p}.{leaf}") for p in PARTS[kind]]
            first = convert(pieces[0][:0])
            fused = torch.empty((like.shape[0], *pieces[0].shape[1:]), dtype=first.dtype, device=first.device)
            row = 0
            for piece in pieces:
                fused[row : row + piece.shape[0]].copy_(piece)
                row += piece.shape[0]
            out[name] = fused
            del pieces
        elif name in state:
            out[name] = convert(state.pop(name))
    return out

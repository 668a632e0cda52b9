"""A step's traffic between host and device: one upload before it, one download after it.

On a GPU a step is fast when the host never waits for the device inside it. Everything a step needs
that does not depend on the tokens it draws is known on the host before it starts: the forward's
layout (positions, pool slots, block tables, the rows whose logits are wanted), each request's
sampling parameters and its keyed uniforms (randomness.py). `Upload` collects those host arrays;
`Staging.send` packs them into one buffer (pinned on CUDA) and moves them with ONE non-blocking
copy, after which the step reads device views of it. When the step is done, `Staging.download`
brings back what the host must know (the tokens and how many were accepted, and logprobs when a
request asks for them) with ONE copy.

Each runner has its own `Staging` (a persistent buffer: allocating pinned memory per step would
cost more than the copy) and counts its uploads and downloads; tests/test_transfers.py checks that
a speculative step makes no other transfer and at most one of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

WORD = np.int64  # every array travels as 64-bit words: integers widened, fp64 reinterpreted bit for bit


@dataclass
class Upload:
    """Named host arrays bound for the device, sent together by `Staging.send`; afterwards
    `device[name]` is each one's device tensor (int64, int32, fp64 or bool, as added)."""

    arrays: dict[str, tuple[np.ndarray, torch.dtype]] = field(default_factory=dict)
    device: dict[str, torch.Tensor] = field(default_factory=dict)
    scopes: int = 0

    def scope(self) -> str:
        """A fresh name prefix, for one of several forwards that share this upload."""
        self.scopes += 1
        return f"{self.scopes}."

    def add(self, name: str, values, dtype: torch.dtype = torch.int64) -> None:
        """values: an array-like of ints (int64 / int32 / bool on the device) or floats (fp64)."""
        if name in self.arrays:
            raise ValueError(f"upload already holds {name!r}")
        host = np.asarray(values, dtype=np.float64 if dtype == torch.float64 else WORD)
        self.arrays[name] = (host, dtype)


class Staging:
    """One runner's staging buffer and its transfer counts (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.int64)
        self.words = self.buffer.numpy()  # the host view the arrays are written into
        self.copied: torch.cuda.Event | None = None  # the last upload's copy (the buffer is reused after it)
        self.uploads = 0
        self.downloads = 0

    def send(self, upload: Upload) -> dict[str, torch.Tensor]:
        """Move every array of `upload` to the device in one copy; fills and returns upload.device."""
        sizes = [a.size for a, _ in upload.arrays.values()]
        total = sum(sizes)
        if total > self.buffer.numel():
            self.buffer = torch.empty(max(total, 2 * self.buffer.numel()), dtype=torch.int64, pin_memory=self.pinned)
            self.words = self.buffer.numpy()
        elif self.copied is not None:
            self.copied.synchronize()  # the previous copy has read the buffer (normally long done)
        offset = 0
        for (array, _), n in zip(upload.arrays.values(), sizes):
            self.words[offset : offset + n] = array.ravel().view(WORD) if array.dtype == np.float64 else array.ravel()
            offset += n
        on_device = self.buffer[:total].to(self.device, non_blocking=True)  # [total] int64: THE upload
        if self.pinned:
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            on_device = on_device.clone()  # (on CPU .to is the buffer itself, which the next upload rewrites)
        self.uploads += 1
        offset = 0
        for (name, (array, dtype)), n in zip(upload.arrays.items(), sizes):
            words = on_device[offset : offset + n].view(array.shape)
            upload.device[name] = words.view(torch.float64) if dtype == torch.float64 else words.to(dtype)
            offset += n
        return upload.device

    def download(self, tensors: list[torch.Tensor]) -> list[list[list]]:
        """Bring tensors [B_i, n_i] (any B_i) to the host in one copy: per tensor, its rows as
        lists, of ints or, for a floating tensor, of floats (fp32 and fp64 values exactly: they
        travel as the 64-bit words of their fp64 values, packed beside the ints)."""
        words = [t.double().view(torch.int64) if t.is_floating_point() else t.long()
                 for t in tensors]
        packed = torch.cat([w.flatten() for w in words])  # [sum B_i * n_i] int64
        host = packed.cpu().numpy()  # THE download
        self.downloads += 1
        out, start = [], 0
        for t in tensors:
            rows, size = t.shape[0], t.numel()
            part = host[start : start + size]
            part = part.view(np.float64) if t.is_floating_point() else part
            out.append(part.reshape(rows, size // rows).tolist() if rows else [])
            start += size
        return out

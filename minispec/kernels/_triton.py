"""Import Triton the way minispec's kernels need it.

Triton compiles for GPUs only; on a machine without CUDA its interpreter runs the same kernels on
CPU (slowly), which is how the tests check them there. The interpreter is chosen when a kernel is
decorated, so `TRITON_INTERPRET` must be set before `triton` is first imported: every kernel file
imports `triton` and `tl` from here. A process that sets `TRITON_INTERPRET=0` itself (ahead-of-time
compilation for a GPU that is not there) keeps its choice.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["triton", "tl"]

"""What this CPU runs natively: the one place every CPU fast path asks (skip on a first read).

x86 CPUs come in kinds that matter here:
* AVX2 (+FMA) only: many laptops and older servers, and x86 emulation on Apple silicon.
  No native bf16: bf16 matmuls are emulated, and oneDNN refuses to prepack a bf16 weight
  (its reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT); fp32 prepacking works.
* AVX512 (F, BW, VL, DQ): oneDNN prepacks bf16 weights, still without native bf16 arithmetic.
* AVX512-BF16: native bf16 dot products.
* AMX: bf16 tile matmuls, on top of AVX512-BF16.
Which CPUs are which, and what each kind measured: docs/cpu-performance.md.

`cpu_caps()` reads the hardware once and returns a frozen `CpuCaps`. The environment variable
MINISPEC_CPU_ISA (avx2, avx512, avx512_bf16, amx) makes the library decide AS ON a lesser CPU:
every feature above the named level reads as absent. So a test suite on an AMX Xeon takes the
AVX2 branches too. Asking for more than the hardware has is an error, never a crash later inside
oneDNN. No fast path discovers a capability by catching an exception.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

ISA_ENV = "MINISPEC_CPU_ISA"
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")  # each level includes the ones before it


@dataclass(frozen=True)
class CpuCaps:
    """The native features of the CPU the library decides for (possibly capped by MINISPEC_CPU_ISA)."""

    avx2: bool  # AVX2 + FMA: torch's vectorized CPU kernels
    avx512: bool  # AVX512 F/BW/VL/DQ
    avx512_bf16: bool  # native bf16 dot products
    amx: bool  # AMX tiles (bf16 matmuls)
    avx_ne_convert: bool  # bf16 <-> fp32 conversion instructions without AVX512 (newer Intel client chips)
    capped: str | None = None  # the MINISPEC_CPU_ISA level these caps were capped to, if any

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run natively (oneDNN), rather than emulated through fp32."""
        return self.avx512_bf16 or self.amx

    @property
    def onednn_bf16_prepack(self) -> bool:
        """oneDNN can reorder (prepack) a bf16 linear weight: the hardware check inside torch's
        `mkldnn._reorder_linear_weight`."""
        return self.avx512 or self.avx_ne_convert

    @property
    def level(self) -> str:
        """The highest of LEVELS this CPU reaches ("none" below AVX2)."""
        reached = [name for name, on in zip(LEVELS, (self.avx2, self.avx512, self.avx512_bf16, self.amx)) if on]
        return reached[-1] if reached else "none"

    def describe(self) -> str:
        """One line for logs and bench headers, e.g. 'avx2 (no native bf16)'."""
        note = "native bf16" if self.native_bf16 else "bf16 prepack, no native bf16" if self.onednn_bf16_prepack \
            else "no native bf16"
        return f"{self.level} ({note})" + (f", decided as {ISA_ENV}={self.capped}" if self.capped else "")

    def capped_to(self, level: str) -> CpuCaps:
        """These caps with every feature above `level` removed."""
        if level not in LEVELS:
            raise ValueError(f"{ISA_ENV}={level!r}: use one of {', '.join(LEVELS)}")
        rank, reached = LEVELS.index(level), LEVELS.index(self.level) if self.level in LEVELS else -1
        if rank > reached:
            raise ValueError(f"{ISA_ENV}={level}: this CPU reaches only {self.level}; the variable can lower the "
                             f"level the library decides for, not raise it")
        return CpuCaps(avx2=self.avx2, avx512=self.avx512 and rank >= 1, avx512_bf16=self.avx512_bf16 and rank >= 2,
                       amx=self.amx and rank >= 3, avx_ne_convert=self.avx_ne_convert and rank >= 1, capped=level)


def _cpu_flags() -> frozenset[str]:
    """The kernel's flags for this CPU (Linux /proc/cpuinfo); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


@functools.lru_cache(maxsize=1)
def hardware_caps() -> CpuCaps:
    """What the hardware runs, uncapped: torch's own checks (the same cpuinfo its kernels dispatch
    on), and /proc/cpuinfo for the one flag torch does not expose."""
    cpu = torch.cpu
    return CpuCaps(
        avx2=cpu._is_avx2_supported(),
        avx512=cpu._is_avx512_supported(),
        avx512_bf16=cpu._is_avx512_bf16_supported(),
        amx=cpu._is_amx_tile_supported(),
        avx_ne_convert="avx_ne_convert" in _cpu_flags(),
    )


def cpu_caps() -> CpuCaps:
    """The caps every fast path decides by: the hardware's, capped by $MINISPEC_CPU_ISA when set."""
    level = os.environ.get(ISA_ENV) or None
    caps = hardware_caps()
    return caps if level is None else caps.capped_to(level)

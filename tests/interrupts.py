"""Test helper: a KeyboardInterrupt at every point of a call, one point at a time.

A signal's Python handler (SIGINT's raises KeyboardInterrupt) runs between two bytecode
instructions of whatever code is running. `interrupted` raises KeyboardInterrupt before the n-th
instruction executed in the named source files, through a trace function, so a test can walk n
from 1 until the call completes and check the state each interrupt leaves. That covers every
point a real signal can land at in those files (CPython runs handlers at a subset of them), and
more: an interrupt inside a C call (list.pop, dict assignment) cannot happen, and none is tried.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType


def interrupted(call: Callable[[], object], n: int, *modules: ModuleType) -> bool:
    """Run call() with a KeyboardInterrupt raised before the n-th instruction it executes in
    `modules`' files (counting from 1). True if the interrupt was raised (and reached here),
    False if the call finished before its n-th instruction there."""
    files = {m.__file__ for m in modules}
    executed = 0

    def trace(frame, event, arg):
        nonlocal executed
        if frame.f_code.co_filename not in files:
            return None  # (no per-instruction events for frames in other files)
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            executed += 1
            if executed == n:
                raise KeyboardInterrupt  # (raised into the frame at that instruction; tracing stops)
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(previous)
    return False


def every_interrupt(setup: Callable[[], object], call: Callable[[object], object], check: Callable[[object], None],
                    *modules: ModuleType, stride: int = 1) -> int:
    """For n = 1, 1 + stride, ...: a fresh state from setup(), call(state) interrupted before its
    n-th instruction in `modules`, then check(state); until a call completes uninterrupted (whose
    state is checked too). Returns the number of interrupts tried."""
    n = 1
    while True:
        state = setup()
        hit = interrupted(lambda: call(state), n, *modules)
        check(state)
        if not hit:
            return (n - 1) // stride
        n += stride

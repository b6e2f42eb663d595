"""A torch.compile'd function called without ever recompiling (CompiledDecode's graphs).

The graphs are compiled at start-up and then called under `set_stance("fail_on_recompile")`:
a call that no graph's guards accept raises before anything runs, and the caller takes its eager
path instead, so serving never stalls on a compile.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

# cpp_wrapper: the kernels are called from C++, not Python (most of the gain at one row);
# cpp.dynamic_threads: the C++ loops take their OpenMP thread count at run time, not at compile
# time, so a call keeps to the threads ThreadPolicy gives it (--decode-threads)
INDUCTOR_OPTIONS = {"cpp_wrapper": True, "cpp.dynamic_threads": True}
# dynamo's message (a RuntimeError) when a call would need a new graph under this stance
_RECOMPILE_REFUSED = "stance is 'fail_on_recompile'"
Result = TypeVar("Result")


class GraphRefused(Exception):
    """No compiled graph covers the call (dynamo's reason in the message); nothing ran."""


def call_compiled(compiled: Callable[..., Result], *args) -> Result:
    """`compiled(*args)` with recompiling refused: GraphRefused when its guards accept no graph."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return compiled(*args)
    except RuntimeError as err:   # raised by the guards, before the graph runs
        if _RECOMPILE_REFUSED not in str(err):
            raise
        raise GraphRefused(str(err)) from err

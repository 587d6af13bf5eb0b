"""Triton kernels compiled for an H100 (sm_90) with Triton's own ptxas: no GPU needed.
Shared by the scripts that inspect the compiled kernels."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)


def compile_for_h100(kernel: Any, types: dict[str, str], constants: dict[str, Any],
                     options: dict[str, int], divisible: tuple[str, ...] = ()) -> Any:
    """`kernel` compiled with the given argument types (every other argument is a
    constexpr of `constants`) and options (num_warps, num_stages), specialized as a launch
    specializes it: every pointer 16-byte aligned (as torch allocates), and the integers
    named in `divisible` multiples of 16. Without that, the compiler can prove no load
    contiguous beyond one element, and the counts below describe a kernel no launch runs."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 runs kernels in the interpreter: unset it to "
                         "compile")
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items()
             if kind.startswith("*") or name in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs={
        (kernel.arg_names.index(name),): value for name, value in constants.items()},
        attrs=attrs)
    return triton.compile(source, target=H100, options=options)


def resources(compiled: Any) -> dict[str, int]:
    """Registers per thread (REG) and spill stack bytes per thread (STACK), as cuobjdump
    reads them from the cubin."""
    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", usage)}

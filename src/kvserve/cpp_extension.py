"""Builds the project's C++ CPU kernels on first use (cached under ~/.cache/torch_extensions,
a folder for each checkout), for the machine's own instruction set. A kernel that fails to
build is reported once and left out, and the plain-torch path runs instead;
`KVSERVE_CPU_KERNELS=0` leaves all out.
`KVSERVE_CPU_CFLAGS` adds compiler flags, e.g. `-mno-avx512f -mno-avxvnni -mno-amx-tile` to
run the kernels an AVX2-only CPU gets (with `ATEN_CPU_CAPABILITY=avx2` and
`ONEDNN_MAX_CPU_ISA=AVX2` for torch's own)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


def build(name: str, sources: list[Path], what: str,
          extra_cflags: Sequence[str] = ()) -> ModuleType | None:
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = build_name(name, sources, extra_cflags)

        logger.info("loading the %s (compiled on first use, under a minute on 2 cores)", what)
        build_directory = Path(_get_build_directory(name, verbose=False))
        with _exclusive(build_directory):
            return load(name=name, sources=[str(s) for s in sources],
                        extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                        extra_ldflags=["-fopenmp"], build_directory=str(build_directory),
                        verbose=False)
    except Exception as e:  # noqa: BLE001 (any build failure means: use the torch path)
        logger.warning("kvserve: %s unavailable (%s); using plain torch", what, e)
        return None


def build_name(name: str, sources: Sequence[Path], extra_cflags: Sequence[str]) -> str:
    """`name` made unique to the sources' folder, torch and the flags: two checkouts or
    installs (tests in one, a server from another) that shared one build rebuilt it, 45-50 s
    on 2 cores, each time they took turns."""
    import torch

    origin = [str(Path(sources[0]).parent.resolve()), torch.__version__,
              str(Path(torch.__file__).parent), *extra_cflags]
    return name + "_" + hashlib.sha1(" ".join(origin).encode()).hexdigest()[:8]


@contextlib.contextmanager
def _exclusive(build_directory: Path) -> Iterator[None]:
    """One process at a time builds or loads, under a lock the system drops when its holder
    dies. torch's own lock is a file that a process killed mid-build leaves behind, and
    every later build waits for it forever; under ours, any such file is stale."""
    with open(build_directory / "kvserve.flock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The kernels of `csrc/` (norms, activation, GEMM, paged decode attention, the Llama
    decode stack) as one module, or None where they do not build."""
    return build("kvserve_cpu", sorted(CSRC.glob("*.cpp")), "CPU kernels",
                 os.environ.get("KVSERVE_CPU_CFLAGS", "").split())

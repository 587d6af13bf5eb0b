import platform
import resource

import pytest
import torch

from kvserve.worker.cpu_allocator import retain_freed_memory

_PAGES = 2048  # an 8 MiB tensor: served by mmap under glibc's default 128 KiB threshold


def _faults_filling_a_fresh_tensor() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(_PAGES * 4096, dtype=torch.uint8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_step_temporary_is_reused_without_page_faults():
    assert retain_freed_memory()
    _faults_filling_a_fresh_tensor()  # grows the heap once
    assert _faults_filling_a_fresh_tensor() < _PAGES // 8

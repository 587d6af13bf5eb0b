import mmap
import platform
import resource

import pytest
import torch

from kvserve.worker.cpu_allocator import advise_huge_pages, retain_freed_memory

_PAGES = 2048  # an 8 MiB tensor: served by mmap under glibc's default 128 KiB threshold


def _faults_filling_a_fresh_tensor() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(_PAGES * 4096, dtype=torch.uint8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_step_temporary_is_reused_without_page_faults():
    assert retain_freed_memory()
    _faults_filling_a_fresh_tensor()  # grows the heap once
    # A small allocation between two fills can take the freed block's first bytes, and the
    # heap then grows once more; a fill after that reuses freed memory. A heap that earlier
    # tests left fragmented takes a few more fills to get there (four after the attention
    # tests, one when run alone).
    assert min(_faults_filling_a_fresh_tensor() for _ in range(8)) < _PAGES // 8


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def _huge_kib_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off or absent")
def test_advised_memory_is_mapped_on_huge_pages_when_touched():
    # Fresh private anonymous pages, none touched yet (shared ones are not anonymous memory).
    region = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    assert advise_huge_pages(tensor)
    tensor.fill_(1)
    assert _huge_kib_of_mapping(tensor.data_ptr()) >= 8 << 10
    del tensor


def test_memory_within_one_huge_page_is_not_advised():
    assert not advise_huge_pages(torch.empty(4096, dtype=torch.uint8))

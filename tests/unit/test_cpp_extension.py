"""The kernels' build: its lock (a build killed midway must not stall every later one) and
its folder (one for each checkout and set of flags)."""

from __future__ import annotations

import subprocess
import sys

from kvserve.cpp_extension import _exclusive, build_name


def test_a_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    (tmp_path / "lock").touch()  # torch's lock, as a process killed mid-build leaves it
    with _exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, pathlib; from kvserve.cpp_extension import _exclusive\n"
         "with _exclusive(pathlib.Path(sys.argv[1])):\n"
         "    print('held', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    with _exclusive(tmp_path):  # would wait forever on a lock that outlived its holder
        pass


def test_each_source_folder_and_set_of_flags_builds_apart(tmp_path):
    """Two checkouts that shared one build folder rebuilt it each time they took turns."""
    here, there = [tmp_path / "a" / "x.cpp"], [tmp_path / "b" / "x.cpp"]
    assert build_name("k", here, []) == build_name("k", here, [])
    assert build_name("k", here, []) != build_name("k", there, [])
    assert build_name("k", here, []) != build_name("k", here, ["-mno-avx512f"])
    assert build_name("k", here, []).startswith("k_")

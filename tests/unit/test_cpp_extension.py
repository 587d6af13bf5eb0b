"""The kernels' build lock: a build killed midway must not stall every later one."""

from __future__ import annotations

import subprocess
import sys

from kvserve.cpp_extension import _exclusive


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

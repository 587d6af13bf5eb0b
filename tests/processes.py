"""Processes seen through Linux's /proc: the workers a server spawned, and whether one runs."""

from __future__ import annotations

from pathlib import Path


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing workers `pid` spawned (Linux's /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Running still: neither gone nor a zombie (whose pipes are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


"""Starting `kvserve serve` as a subprocess and waiting until it answers (benchmarks, tests)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import IO

import httpx

from kvserve.worker.tensor_parallel import free_port


@contextmanager
def server_process(model: str, flags: list[str], env: dict[str, str] | None = None,
                   timeout: float = 600, log: IO[str] | None = None,
                   stop_signal: int = signal.SIGTERM) -> Iterator[str]:
    """Runs `kvserve serve MODEL FLAGS` on a free loopback port; yields its base URL once
    `/health` answers and stops it afterwards with `stop_signal`. Its output goes to `log`, or
    to a temporary file: not a pipe, which would block the server once full."""
    port = free_port()
    command = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model,
               "--port", str(port), *flags]
    url = f"http://127.0.0.1:{port}"
    with nullcontext(log) if log else tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    log.seek(0)
                    raise RuntimeError(f"{' '.join(command)} did not start:\n{log.read()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.send_signal(stop_signal)
            proc.wait(timeout=60)

"""Tensor-parallel execution: one `ModelRunner` per rank, each in a process of its own.

Every call goes to all ranks, which run it in step (their forward passes meet in the
row-parallel layers' all-reduces); rank 0's result comes back. The engine process holds no
weights and joins no process group, so several engines can live in one process. KV read
for a migration comes back whole (each rank's KV heads, concatenated), and KV written is
split among the ranks by heads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvserve.errors import EngineDeadError
from kvserve.worker.pending_output import PendingOutput
from kvserve.worker.tensor_parallel import free_port, init_tensor_parallel

# Where the KV heads lie in `ModelRunner.read_kv_blocks` output.
_HEADS_DIM = 3


def _worker(config: EngineConfig, rank: int, port: int, pipe: Connection) -> None:
    from kvserve.worker.model_runner import ModelRunner

    size = config.tensor_parallel_size
    if config.device.startswith("cuda"):
        config = replace(config, device=f"cuda:{rank}")
        torch.cuda.set_device(config.device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        init_tensor_parallel(rank, size, port, config.device)
        runner = ModelRunner(config)
    except Exception as e:  # noqa: BLE001 (reported to the engine, which raises it)
        pipe.send(e)
        return
    pipe.send(runner.num_blocks)
    while (call := pipe.recv()) is not None:
        method, args = call
        try:
            pipe.send(getattr(runner, method)(*args))
        except Exception as e:  # noqa: BLE001 (reported to the engine, which raises it)
            pipe.send(e)


def _stop(pipes: list[Connection], processes: list[multiprocessing.Process]) -> None:
    for pipe in pipes:
        with contextlib.suppress(OSError):
            pipe.send(None)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def _rank_exited(rank: int, error: Exception) -> EngineDeadError:
    """What reading a rank's pipe (EOF, or a reset: the pipes are socket pairs) or writing it
    (a broken pipe) means: its process is gone."""
    detail = f" ({error})" if str(error) else ""
    return EngineDeadError(f"tensor-parallel rank {rank} exited{detail}")


class TensorParallelExecutor:
    """Runs `config.tensor_parallel_size` ranks; has the `ModelRunner` methods the engine
    calls."""

    def __init__(self, config: EngineConfig) -> None:
        # Spawned, not forked: a fork would inherit the engine process's OpenMP threads.
        context = multiprocessing.get_context("spawn")
        port = free_port()
        self.pipes: list[Connection] = []
        processes = []
        for rank in range(config.tensor_parallel_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker, args=(config, rank, port, theirs),
                                      name=f"kvserve-tp{rank}", daemon=True)
            process.start()
            self.pipes.append(ours)
            processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self.pipes, processes)
        self.num_blocks = self._gather()[0]
        self.host_kv_cache = None  # in the ranks; reached through the methods below

    def _gather(self) -> list[Any]:
        results = []
        for rank, pipe in enumerate(self.pipes):
            try:
                results.append(pipe.recv())
            except (EOFError, OSError) as e:
                raise _rank_exited(rank, e) from None
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    def _call_all(self, method: str, per_rank_args: list[tuple[Any, ...]]) -> list[Any]:
        for rank, (pipe, args) in enumerate(zip(self.pipes, per_rank_args, strict=True)):
            try:
                pipe.send((method, args))
            except OSError as e:
                raise _rank_exited(rank, e) from None
        return self._gather()

    def _call(self, method: str, *args: Any) -> list[Any]:
        return self._call_all(method, [args] * len(self.pipes))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's tokens, with the disk blocks any rank could not read its part of."""
        outputs = self._call("execute_model", sched)
        failed = dict.fromkeys(h for output in outputs for h in output.failed_promotions)
        return replace(outputs[0], failed_promotions=list(failed))

    def launch(self, sched: SchedulerOutput) -> PendingOutput:
        """The step run to the end: the ranks' ids come back through pipes."""
        return PendingOutput(self.execute_model(sched))

    def swap_seconds_per_block(self) -> float:
        return max(self._call("swap_seconds_per_block"))

    def disk_blocks(self) -> list[bytes]:
        """The blocks whose part every rank holds on disk (in rank 0's order); a part whose
        block another rank lacks (a process killed between the ranks' writes) is deleted."""
        found = self._call("disk_blocks")
        complete = set.intersection(*(set(hashes) for hashes in found))
        self._call_all("delete_disk_blocks",
                       [([h for h in hashes if h not in complete],) for hashes in found])
        return [h for h in found[0] if h in complete]

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return torch.cat(self._call("read_kv_blocks", block_ids), dim=_HEADS_DIM)

    def write_host_blocks(self, host_blocks: list[int], kv: torch.Tensor) -> None:
        parts = kv.chunk(len(self.pipes), dim=_HEADS_DIM)
        self._call_all("write_host_blocks", [(host_blocks, part) for part in parts])

    def add_lora(self, name: str, path: str) -> None:
        self._call("add_lora", name, path)

    def remove_lora(self, name: str) -> None:
        self._call("remove_lora", name)

    def generator_state(self, request_id: str) -> bytes | None:
        return self._call("generator_state", request_id)[0]

    def shutdown(self) -> None:
        self._finalizer()

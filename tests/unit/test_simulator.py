"""The cluster simulator: the real scheduler and KV manager on a fitted step cost. Its
cost fits recover a linear model, an engine traces each step's work, a lone request's latency
is the model's arithmetic, and prefix-aware routing, migration and disaggregation act on
simulated replicas as they do on real ones."""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.benchmarks import simulate
from kvserve.cluster.simulator import (
    ClusterSpec,
    SimRequest,
    Simulation,
    StepCostModel,
    poisson_arrivals,
)
from kvserve.config import EngineConfig
from kvserve.core.scheduler.output import StepShape
from kvserve.engine import llm_engine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.cli import build_parser
from kvserve.sampling_params import SamplingParams
from kvserve.tools.checkpoint_files import write_json
from kvserve.tools.make_model import PRESETS, hf_config
from tests.conftest import random_prompts

COST = StepCostModel(fixed=0.010, per_decode=0.001, per_prefill_token=0.0001)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    folder = tmp_path_factory.mktemp("shapes")
    write_json(folder / "config.json", hf_config(PRESETS["tiny"]))
    return EngineConfig.create(str(folder), kv_cache_memory=2 << 20, max_num_seqs=8)


@pytest.mark.parametrize("floor", [0.0, 0.03])
def test_the_fit_recovers_a_linear_cost_and_the_floor_of_a_step_with_prefill(floor: float
                                                                             ) -> None:
    def step_ms(decodes: int, chunk: int, context: int) -> float:
        linear = 0.01 + 0.001 * decodes + 0.0001 * chunk + 2e-6 * decodes * context
        return 1e3 * (max(linear, floor) if chunk else linear)

    runs = [{"context": ctx, "rows": [{"decodes": d, "chunk": c, "step ms": step_ms(d, c, ctx)}
                                      for d in (1, 8) for c in (0, 64, 256)],
             "prefill": {"prefill tokens": 1024, "step ms": step_ms(0, 1024, 0)}}
            for ctx in (64, 512)]
    fitted = StepCostModel.fit(runs)
    assert fitted.fixed == pytest.approx(0.01, abs=1e-6)
    assert fitted.per_decode == pytest.approx(0.001, abs=1e-6)
    assert fitted.per_prefill_token == pytest.approx(0.0001, abs=1e-8)
    assert fitted.per_context_token == pytest.approx(2e-6, abs=1e-9)
    assert fitted.prefill_step_floor == pytest.approx(floor)
    assert fitted.seconds(StepShape(0, 100, 0)) == pytest.approx(max(0.02, floor))
    assert fitted.seconds(StepShape(0, 1000, 0)) == pytest.approx(0.11)  # past the floor
    assert fitted.seconds(StepShape(3, 0, 30)) == pytest.approx(0.013 + 60e-6)


def test_a_cost_model_file_that_is_not_bench_step_json_is_named(tmp_path: Path) -> None:
    missing, latency = tmp_path / "step.json", tmp_path / "latency.json"
    write_json(latency, {"benchmark": "latency", "rows": []})
    with pytest.raises(ValueError, match=f"cost_model: cannot read {missing}"):
        StepCostModel.load([str(missing)])
    with pytest.raises(ValueError, match=f"cost_model: {latency} is not the JSON of"):
        StepCostModel.load([str(latency)])


def test_the_trace_fit_recovers_a_linear_cost_through_stalls() -> None:
    steps = []
    for i in range(200):
        decodes, prompt = 1 + i % 6, 256 * (i % 5 == 0)
        seconds = 0.01 + 0.001 * decodes + 0.0001 * prompt
        stalled = i % 7 == 3  # a step that lost the CPU for a while
        steps.append((StepShape(decodes, prompt, 100 * decodes), seconds + 0.05 * stalled))
    fitted = StepCostModel.fit_trace(steps, "test")
    assert fitted.fixed == pytest.approx(0.01)
    assert fitted.per_decode == pytest.approx(0.001)
    assert fitted.per_prefill_token == pytest.approx(0.0001)


def test_the_trace_fit_needs_both_kinds_of_step() -> None:
    with pytest.raises(ValueError, match="only decode"):
        StepCostModel.fit_trace([(StepShape(2, 0, 50), 0.01)], "test")


def test_an_engine_traces_the_work_of_its_steps(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.create(str(llama_dir), max_num_batched_tokens=32))
    engine.trace_steps(on=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt in random_prompts([40, 9]):
        engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    trace = engine.trace_steps(on=False)
    assert sum(shape.num_prefill_tokens for shape, _ in trace) == 40 + 9
    assert sum(shape.num_decodes for shape, _ in trace) == 2 * 5
    assert all(seconds > 0 for _, seconds in trace)
    engine.add_request({"prompt_token_ids": [5] * 8}, params)
    engine.step()
    assert engine.trace_steps(on=False) == []  # no longer tracing


def test_a_busy_engines_trace_counts_the_loops_time_between_steps(llama_dir: Path,
                                                                  monkeypatch) -> None:
    """A step's traced seconds are its period: the serving loop's time since the step
    before counts where that step left work to run at once, not after the engine idled."""
    engine = LLMEngine(EngineConfig.create(str(llama_dir)))
    clock = iter(range(10**6))  # each read of the clock is one second later
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(perf_counter=lambda: next(clock),
                                                           monotonic=time.monotonic))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.trace_steps(on=True)
    for _ in range(2):  # the engine idles between the two requests
        engine.add_request({"prompt_token_ids": [5] * 8}, params)
        while engine.has_unfinished_requests():
            engine.step()
            next(clock), next(clock)  # the serving loop's work: two seconds
    # A step reads the clock at its start and end, 1 s apart; after a busy step, the 3 s
    # from that step's end to this one's start count too, and after an idle spell not.
    assert [seconds for _, seconds in engine.trace_steps(on=False)] == [1, 4, 4, 1, 4, 4]


def test_a_lone_request_costs_what_the_model_says(config: EngineConfig) -> None:
    timing = Simulation(ClusterSpec(config, COST, 1)).run(
        [SimRequest(0.0, list(range(3, 103)), 5)])["0"]
    prefill = COST.fixed + 100 * COST.per_prefill_token  # 100 tokens in one chunk
    assert timing.ttft == pytest.approx(prefill)
    assert timing.tpot == pytest.approx(COST.fixed + COST.per_decode)


def shared_heads(num_groups: int, per_group: int) -> list[SimRequest]:
    arrivals = poisson_arrivals(num_groups * per_group, 50.0, seed=0)
    groups = [g for g in range(num_groups) for _ in range(per_group)]
    random.Random(0).shuffle(groups)
    return [SimRequest(t, [10 + g] * 64 + [1000 + i] * 8, 4)
            for i, (t, g) in enumerate(zip(arrivals, groups, strict=True))]


def test_prefix_aware_routing_keeps_groups_together(config: EngineConfig) -> None:
    def hit_rate(router: str) -> float:
        sim = Simulation(ClusterSpec(config, COST, 4, router=router))
        sim.run(shared_heads(8, 6))
        kvs = [r.scheduler.kv_cache for r in sim.replicas]
        return sum(kv.prefix_cache_hits for kv in kvs) / sum(kv.prefix_cache_queries
                                                             for kv in kvs)

    assert hit_rate("prefix-aware") > hit_rate("round-robin")


def test_disaggregated_requests_decode_only_on_decode_replicas(config: EngineConfig) -> None:
    sim = Simulation(ClusterSpec(config, COST, 3, num_prefill=1))
    timings = sim.run(shared_heads(4, 5))
    assert all(t.num_tokens == 4 for t in timings.values())
    assert sim.num_migrations == len(timings)  # each moved once, after its first token
    assert all(not r.scheduler.has_unfinished_requests() for r in sim.replicas)
    assert sim.replicas[0].scheduler.kv_cache.num_used_host_blocks == 0


def test_migration_evens_out_an_imbalanced_load(config: EngineConfig) -> None:
    arrivals = poisson_arrivals(40, 20.0, seed=1)
    requests = [SimRequest(t, list(range(3, 40)), 200 if i % 2 == 0 else 8)
                for i, t in enumerate(arrivals)]

    def p99_ttft(threshold: int) -> tuple[float, int]:
        sim = Simulation(ClusterSpec(config, COST, 2, migration_threshold=threshold))
        ttfts = sorted(t.ttft for t in sim.run(requests).values())
        return ttfts[int(0.99 * (len(ttfts) - 1))], sim.num_migrations

    still, moved = p99_ttft(0), p99_ttft(2)
    assert still[1] == 0 and moved[1] > 0
    assert moved[0] < still[0]



def test_shared_prefix_workloads_leave_each_prompt_a_tail_and_each_group_a_request():
    def work(*flags: str):
        args = build_parser().parse_args(["bench", "simulator", "--model", "m",
                                          "--workload", "shared-prefix", *flags])
        return simulate.workload(args, 1000)

    default = work()  # the validation's own defaults make a workload
    assert len(default.prompts) == 100 and {len(p) for p in default.prompts} == {256}
    assert len({tuple(p[:192]) for p in default.prompts}) == 10
    with pytest.raises(ValueError, match=r"--prefix-len \(256\) must be below --prompt-len "
                                         r"\(256\)"):
        work("--prefix-len", "256")
    with pytest.raises(ValueError, match=r"--groups \(101\) must be <= --num-requests"):
        work("--groups", "101")

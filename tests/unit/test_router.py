"""Routing requests among replicas, on plain Python objects: round-robin, least-loaded, and
a prefix-aware router whose approximate view keeps shared heads on one replica; and the
merge of the replicas' metrics."""

import random

import pytest

from kvserve.cluster.router import (
    LeastLoadedRouter,
    PrefixAwareRouter,
    ReplicaLoad,
    Router,
    make_router,
)
from kvserve.core.kv_cache.hashing import update_block_hashes
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BLOCK = 4
IDLE = [ReplicaLoad(), ReplicaLoad()]


def hashes(tokens, salt=None):
    request = Request("r", list(tokens), SamplingParams(), cache_salt=salt)
    return list(update_block_hashes(request, BLOCK))


def test_round_robin_and_least_loaded():
    router = Router(3)
    assert [router.route([], [ReplicaLoad()] * 3) for _ in range(4)] == [0, 1, 2, 0]
    loads = [ReplicaLoad(3, 1), ReplicaLoad(1, 0), ReplicaLoad(0, 1)]
    assert LeastLoadedRouter(3).route([], loads) == 1


def test_prefix_aware_keeps_a_head_on_the_replica_that_has_it():
    router = PrefixAwareRouter(2, blocks_per_replica=100)
    head = list(range(16))
    first = router.route(hashes(head + [100, 101]), IDLE)
    busier = [ReplicaLoad(5), ReplicaLoad(5)]
    busier[first] = ReplicaLoad(9)  # more loaded, within the balance margin: the cache wins
    assert router.route(hashes(head + [200, 201, 202, 203]), busier) == first
    other = router.route(hashes(list(range(500, 516))), [ReplicaLoad(1), ReplicaLoad(1)])
    assert router.route(hashes(list(range(500, 516))), IDLE) == other
    assert router.route(hashes(head, salt="b"), IDLE) == 0  # a salted head matches nothing


def test_prefix_aware_balances_when_load_is_out_of_balance_or_matches_are_short():
    router = PrefixAwareRouter(2, blocks_per_replica=100, balance_margin=4)
    head = list(range(16))
    assert router.route(hashes(head), IDLE) == 0
    assert router.route(hashes(head), [ReplicaLoad(6), ReplicaLoad(1)]) == 1  # imbalanced
    short = head[:4] + list(range(900, 912))  # one block of four matches: under min_match
    assert router.route(hashes(short), [ReplicaLoad(2), ReplicaLoad(1)]) == 1


def test_a_replicas_view_forgets_its_least_recently_routed_blocks():
    router = PrefixAwareRouter(1, blocks_per_replica=4)
    router.route(hashes(range(16)), [ReplicaLoad()])
    router.route(hashes(range(100, 108)), [ReplicaLoad()])
    view = router.views[0]
    assert len(view) == 4 and list(view)[-2:] == hashes(range(100, 108))


def test_make_router_names_the_choices():
    assert isinstance(make_router("prefix-aware", 2, 10), PrefixAwareRouter)
    with pytest.raises(ValueError, match="router must be one of round-robin, least-loaded, "
                                         "prefix-aware, got 'random'"):
        make_router("random", 2, 10)


def replay_hit_rate(router_name: str) -> float:
    """Shared-prefix groups, shuffled, through two replicas' real KV managers (each pool
    holds about two groups): the fraction of prompt tokens served from a cache."""
    replicas = [KVCacheManager(num_blocks=24, block_size=BLOCK) for _ in range(2)]
    router = make_router(router_name, 2, blocks_per_replica=24)
    rng = random.Random(0)
    prompts = [list(range(1000 * g, 1000 * g + 16)) + [rng.randrange(5000, 9000) for _ in range(3)]
               for g in range(4) for _ in range(6)]
    rng.shuffle(prompts)
    for i, prompt in enumerate(prompts):
        request = Request(str(i), prompt, SamplingParams(), max_tokens=1)
        kv = replicas[router.route(update_block_hashes(request, BLOCK), IDLE)]
        prefix = kv.find_cached_prefix(request)
        cached_tokens = len(prefix) * BLOCK
        assert kv.allocate_slots(request, len(prompt) - cached_tokens, prefix)
        kv.record_lookup(request, cached_tokens)
        request.num_computed_tokens = len(prompt)
        kv.cache_computed_blocks(request)
        kv.free(request)
    return sum(kv.prefix_cache_hits for kv in replicas) / sum(
        kv.prefix_cache_queries for kv in replicas)


def test_prefix_aware_routing_beats_round_robin_on_shared_heads():
    prefix_aware, round_robin = replay_hit_rate("prefix-aware"), replay_hit_rate("round-robin")
    # Each group's head is computed once per replica it reaches: once, against twice.
    assert prefix_aware > round_robin
    assert prefix_aware == pytest.approx((24 - 4) * 16 / (24 * 19))


def test_replica_metrics_merge_with_a_total():
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from kvserve.cluster.metrics import merge_replica_families

    families = {}
    for replica, (tokens, latency) in enumerate([(3, 0.2), (5, 2.0)]):
        registry = CollectorRegistry()
        Counter("tok", "tokens", ["model_name"], registry=registry).labels("m").inc(tokens)
        Histogram("lat", "latency", ["model_name"], buckets=(1.0,),
                  registry=registry).labels("m").observe(latency)
        families[replica] = list(registry.collect())
    samples = {(s.name, s.labels.get("le"), s.labels["replica"]): s.value
               for family in merge_replica_families(families) for s in family.samples}
    assert samples[("tok_total", None, "0")] == 3
    assert samples[("tok_total", None, "all")] == 8
    assert samples[("lat_bucket", "1.0", "all")] == 1
    assert samples[("lat_count", None, "all")] == 2
    assert ("tok_created", None, "all") not in samples

"""The BatchLLM admission order: groups by shared head, decode-heavy requests first."""

import random

from kvserve.engine.prefix_sharing import sharing_order


def group_prompts(num_groups=3, group_size=4, head=8, tail=3):
    prompts, groups = [], []
    for g in range(num_groups):
        for i in range(group_size):
            prompts.append([1000 * g + t for t in range(head)] + [g, i, 7][:tail])
            groups.append(g)
    return prompts, groups


def test_shuffled_groups_come_back_together():
    prompts, groups = group_prompts()
    perm = list(range(len(prompts)))
    random.Random(0).shuffle(perm)
    shuffled = [prompts[i] for i in perm]
    order = sharing_order(shuffled, [4] * len(shuffled), block_size=4)
    assert sorted(order) == list(range(len(shuffled)))
    seen = [groups[perm[i]] for i in order]
    runs = [g for k, g in enumerate(seen) if k == 0 or seen[k - 1] != g]
    assert len(runs) == 3  # each group in one run


def test_decode_heavy_requests_and_groups_go_first():
    prompts, _ = group_prompts(num_groups=2, group_size=3)
    max_tokens = [1, 50, 2, 3, 4, 5]  # group 0 holds the most decode-heavy request
    order = sharing_order(prompts, max_tokens, block_size=4)
    assert order == [1, 2, 0, 5, 4, 3]


def test_ties_keep_the_callers_order_and_short_prompts_are_kept():
    prompts = [[5], [1, 2, 3, 4, 9], [5], [1, 2, 3, 4, 8]]
    order = sharing_order(prompts, [1, 10, 1, 10], block_size=4)
    assert order == [1, 3, 0, 2]


def test_different_salts_never_form_one_group():
    prompts, _ = group_prompts(num_groups=1, group_size=4)
    order = sharing_order(prompts, [4] * 4, block_size=4, salts=["a", "b", "a", "b"])
    assert order == [0, 2, 1, 3]

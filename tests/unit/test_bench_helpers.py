"""The benchmarks' shared workloads and tables, at their edges."""

import pytest

from kvserve.benchmarks.report import print_table
from kvserve.benchmarks.workloads import shared_prefix


def test_a_shared_prefix_workload_needs_a_token_per_prompt():
    assert [len(p) for p in shared_prefix(1, 2, 0, 1, 4, 100).prompts] == [1, 1]
    with pytest.raises(ValueError, match="--prefix-len plus --suffix-len must be >= 1"):
        shared_prefix(1, 2, 0, 0, 4, 100)


def test_a_table_with_no_columns_prints_nothing(capsys):
    print_table([{}], title="ratios")
    print_table([], title="ratios")
    assert capsys.readouterr().out == ""
    print_table([{"a": 1}], title="t")
    assert capsys.readouterr().out == "\nt\n| a |\n|---|\n| 1 |\n"

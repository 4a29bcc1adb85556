"""Dealing `run --stages N --chains K`'s stages into chains (jobs/chain_split.py): a table."""

from __future__ import annotations

import pytest

from layerbus.jobs.chain_split import ChainStages, chains_error, split_stages


@pytest.mark.parametrize("stages, chains, counts", [
    (1, 1, [1]),
    (3, 1, [3]),
    (4, 2, [2, 2]),
    (5, 2, [3, 2]),
    (7, 3, [3, 2, 2]),
    (8, 3, [3, 3, 2]),
    (4, 4, [1, 1, 1, 1]),
])
def test_each_chain_gets_n_over_k_and_the_first_ones_the_rest(stages, chains, counts):
    split = split_stages(stages, chains)
    assert [chain.count for chain in split] == counts
    assert [i for chain in split for i in chain.stages] == list(range(stages)), "every stage once, in order"
    assert [chain.label for chain in split] == [f"chain {i + 1}" for i in range(chains)]


def test_a_chain_is_a_half_open_range_of_stage_indices():
    assert split_stages(5, 2)[1] == ChainStages(index=1, first=3, count=2)
    assert split_stages(5, 2)[1].stages == range(3, 5)


@pytest.mark.parametrize("stages, chains, named", [
    (2, 3, ["--chains 3", "--stages 2", "--chains 2 or fewer", "--stages 3 or more"]),
    (3, 0, ["--chains 0", "--chains 1", "--chains 3"]),
    (3, -1, ["--chains -1"]),
])
def test_bad_chain_counts_are_refused_naming_the_values_and_the_way_out(stages, chains, named):
    message = chains_error(stages, chains)
    assert message is not None and all(part in message for part in named), message
    with pytest.raises(ValueError, match="--chains"):
        split_stages(stages, chains)


def test_good_chain_counts_have_no_error():
    assert chains_error(4, 2) is None and chains_error(1, 1) is None

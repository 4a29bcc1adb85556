"""A --memory-budget is the stage's whole memory: its runtime (measured at start) and its loader's temporary
come out of it before the planner fits weights, KV cache and workspace; --emulate-memory is taken as given,
for emulating a smaller device. tests/cluster/test_memory_budget.py measures a real stage's peak resident
memory (VmHWM) within its budget."""

from __future__ import annotations

import pytest

from layerbus.models.model_files import open_model_dir
from layerbus.stages.host import budget_overrun
from layerbus.stages.memory_budget import largest_tensor_bytes, memory_figures
from tests.helpers.memory import MIB


@pytest.mark.parametrize("device, given, emulated, usable", [
    # A CPU budget: runtime (400 MiB) and loader (L) come out of it.
    ("cpu", 1000 * MIB, None, "1000 MiB - 400 MiB - L"),
    # Too small for the runtime alone: nothing is left, never a negative budget.
    ("cpu", 300 * MIB, None, "0"),
    # An emulated device: as given, nothing subtracted.
    ("cpu", None, 5 * MIB, "5 MiB"),
    ("cpu", 1000 * MIB, 5 * MIB, "5 MiB"),
])
def test_memory_figures(tiny_models, device, given, emulated, usable):
    files = open_model_dir(tiny_models("llama"))
    loader = largest_tensor_bytes(files)
    want = eval(usable.replace("MiB", "* MIB").replace("L", "loader"))  # noqa: S307 - the table's own arithmetic
    figures = memory_figures(files, device, given, 400 * MIB, emulated)
    assert figures["memory_budget"] == max(0, want)


def test_without_a_budget_only_the_loader_comes_out_of_free_memory(tiny_models):
    files = open_model_dir(tiny_models("llama"))
    figures = memory_figures(files, "cpu", None, 400 * MIB)
    assert figures["runtime_bytes"] == 400 * MIB and figures["loader_peak_bytes"] == largest_tensor_bytes(files) > 0
    assert figures["memory_budget"] > 0 and figures["memory_budget_given"] is None


@pytest.mark.parametrize("peak, budget, said", [
    (1100 * MIB, 1150 * MIB, None),  # within
    (1150 * MIB, 1150 * MIB, None),  # exactly the budget is within it
    (1224 * MIB, None, None),  # no --memory-budget: nothing promised
    (1224 * MIB, 1150 * MIB, "1224 MiB is over the --memory-budget of 1150 MiB by 74 MiB (before the load 406 MiB, "
                             "weights 652 MiB, the rest 166 MiB"),
])
def test_a_load_over_its_budget_is_named_with_where_the_memory_went(peak, budget, said):
    message = budget_overrun(peak, budget, before_load_bytes=406 * MIB, weight_bytes=652 * MIB)
    if said is None:
        assert message is None
    else:
        assert said in message and "more --memory-budget" in message

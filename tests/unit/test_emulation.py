"""`--emulate-speed`: a step lasts its cost alone / F, not its wall time stretched by the host's other
stages (stages/emulation.py)."""

import time

import pytest

from layerbus.stages.emulation import cpu_clock, emulated_sleep_s


@pytest.mark.parametrize("wall, cpu, speed, sleep", [
    (0.010, 0.010, 1.0, 0.0),    # no emulation
    (0.010, 0.010, 0.5, 0.010),  # alone: wall = CPU, the step lasts twice as long
    (0.010, 0.010, 0.25, 0.030),
    # Waited 10 ms for a core: a device does not, so the step still lasts 2 x the 10 ms of CPU
    (0.020, 0.010, 0.5, 0.0),
    (0.015, 0.010, 0.5, 0.005),
    (0.030, 0.010, 0.5, 0.0),    # the host is shorter of cores than F leaves: no sleep, never negative
    (0.010, None, 0.5, 0.010),   # not a CPU stage: its wall time stands for its cost alone
    (0.020, None, 0.5, 0.020),
])
def test_an_emulated_step_lasts_its_cpu_time_over_the_speed(wall, cpu, speed, sleep):
    assert emulated_sleep_s(wall, cpu, speed) == pytest.approx(sleep)


def test_the_cpu_clock_counts_a_one_thread_stage_s_work_not_its_waits():
    # GPU stages, and stages of several threads (whose serving thread does only its share), keep the wall time
    assert cpu_clock("cuda:0", 1) is None and cpu_clock("mps", 1) is None and cpu_clock("cpu", 2) is None
    began = cpu_clock("cpu", 1)
    time.sleep(0.05)  # waiting (for a core, or a message) costs no CPU
    slept = cpu_clock("cpu", 1) - began
    assert slept < 0.02, f"{slept:.3f} s of CPU over a 50 ms sleep"
    began, spin_until = cpu_clock("cpu", 1), time.monotonic() + 0.05
    while time.monotonic() < spin_until:
        pass
    assert cpu_clock("cpu", 1) - began > 0.0

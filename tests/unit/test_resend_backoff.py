"""When the broker sends a step again: doubling per attempt, capped (broker/pipeline.resend_after_s)."""

import pytest

from layerbus.broker.pipeline import MAX_RESEND_BACKOFF, resend_after_s


@pytest.mark.parametrize("timeout_s, attempt, expected_s", [
    (60.0, 0, 60.0),     # the first attempt waits the configured timeout
    (60.0, 1, 120.0),    # each resend waits twice as long as the one before
    (60.0, 2, 240.0),
    (60.0, 3, 480.0),
    (60.0, 4, 480.0),    # capped: a step is never left out for ever
    (60.0, 50, 480.0),
    (1.0, 1, 2.0),
])
def test_resend_waits_double_per_attempt_up_to_the_cap(timeout_s, attempt, expected_s):
    assert resend_after_s(timeout_s, attempt) == expected_s


def test_the_cap_is_a_multiple_of_the_timeout():
    assert resend_after_s(10.0, 100) == 10.0 * MAX_RESEND_BACKOFF

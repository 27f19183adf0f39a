"""The parts of vlmcore.train.resilience that need no process group: the fault injection hook's
format (tests only, refused with the variable named) and the refusal of a collective timeout
shorter than a step (the multi-process runs: tests/distributed/test_train_resilience.py)."""

import pytest

from vlmcore.config import ConfigError, ResilienceConfig
from vlmcore.train.resilience import Fault, check_timeout, parse_faults


def test_faults_are_read_from_the_variable():
    assert parse_faults("kill rank=1 step=3; slow rank=0 seconds=0.25;") == [
        Fault("kill", 1, 3),
        Fault("slow", 0, 1, 0.25),
    ]
    assert parse_faults("") == []


@pytest.mark.parametrize("text", ["explode rank=1", "kill step=3", "kill rank=one", "hang rank=1 when=3"])
def test_a_bad_fault_names_the_variable(text):
    with pytest.raises(ValueError, match=r"\$VLMCORE_TEST_FAULT"):
        parse_faults(text)


def test_a_collective_timeout_shorter_than_a_step_is_refused_by_key():
    cfg = ResilienceConfig(collective_timeout_s=30)
    check_timeout(cfg, 29.0, step=10)
    with pytest.raises(
        ConfigError, match=r"^resilience.collective_timeout_s: 30 s is shorter than a step \(31.0 s"
    ) as e:
        check_timeout(cfg, 31.0, step=10)
    assert e.value.key == "resilience.collective_timeout_s"

"""The reward workers: a reward that raises, sleeps past the time limit, is stuck in the regex
engine, returns NaN or kills its own process scores 0 and is counted by reason, while the other
values stay right and in the batch's order; a user's module:function imports in the workers; the
workers import no torch; closing the pool leaves no process behind."""

import os
import pickle
import signal
import sys
import textwrap

import psutil
import pytest
import torch  # the trainer holds torch: the workers must not import it

from vlmcore.config import ConfigError
from vlmcore.rewards import RewardWorkers, check_rewards

USER_MODULE = "rewards_test_user_module"
USER_REWARDS = textwrap.dedent(
    """
    import os
    import re
    import sys
    import time


    def misbehave(completion, answer, sample):
        if completion == "raise":
            raise KeyError("no such field")
        if completion == "sleep":
            time.sleep(30)
        if completion == "nan":
            return float("nan")
        if completion == "inf":
            return float("inf")
        if completion == "text":
            return "1.0"
        if completion == "exit":
            os._exit(3)
        if completion == "backtrack":
            # Minutes inside the regex engine, which holds the GIL and checks no signal.
            re.match(r"(a+)+$", "a" * 40 + "b")
        return len(completion) / 10


    def torch_imported(completion, answer, sample):
        return float("torch" in sys.modules)
    """
)
TIME_LIMIT_S = 0.5


@pytest.fixture(scope="module")
def user_module_on_path(tmp_path_factory):
    """The user's reward module in a directory on sys.path (the workers get the trainer's)."""
    directory = tmp_path_factory.mktemp("user_rewards")
    (directory / f"{USER_MODULE}.py").write_text(USER_REWARDS)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(directory))
        yield


@pytest.fixture(scope="module")
def pool(user_module_on_path):
    specs = check_rewards(
        [{"name": "exact_match", "weight": 1.0}, {"name": f"{USER_MODULE}:misbehave", "weight": 2.0}],
        "train.stages.rl.grpo.rewards",
    )
    with RewardWorkers(specs, workers=2, timeout_s=TIME_LIMIT_S) as workers:
        yield workers


def test_failed_calls_score_zero_counted_by_reason_and_the_rest_stay_right_and_in_order(pool):
    # Two workers: completions 0-5 go to one, 6-11 to the other. The sleeping call, the exit and
    # the backtracking regex sit in the middle of a chunk, so the calls done before them run again
    # on the replacement.
    completions = ["ok", "raise", "sleep", "fine", "nan", "good", "text", "exit", "inf", "backtrack", "last one", "x"]
    answers = ["ok", "x", "x", "fine", "x", "bad", "x", "x", "x", "x", "last one", "y"]
    scores = pool.score(completions, answers, [{}] * len(completions))

    misbehave = f"{USER_MODULE}:misbehave"
    assert scores.per_reward["exact_match"] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert scores.per_reward[misbehave] == [0.2, 0.0, 0.0, 0.4, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0, 0.8, 0.1]
    assert scores.totals == pytest.approx([1.4, 0.0, 0.0, 1.8, 0.0, 0.8, 0.0, 0.0, 0.0, 0.0, 2.6, 0.2])
    assert dict(scores.failures[misbehave]) == {
        "raised:KeyError": 1,
        "timeout": 2,  # the sleep and the regex
        "not_a_number": 3,  # NaN, infinity and a string
        "worker_died": 1,
    }
    assert not scores.failures["exact_match"]
    assert pool.restarts == 3  # the timed-out calls' workers and the one that exited, replaced

    metrics = scores.metrics()
    assert metrics["reward"] == pytest.approx(sum(scores.totals) / 12)
    assert metrics[f"reward/{misbehave}"] == pytest.approx(1.9 / 12)
    assert metrics[f"reward_failures/{misbehave}/timeout"] == 2.0


def test_the_pool_goes_on_after_replacing_workers(pool):
    scores = pool.score(["a cat", "dogs"], ["cat", "dog"], [{}, {}])
    assert scores.per_reward["exact_match"] == [1.0, 0.0]
    assert scores.per_reward[f"{USER_MODULE}:misbehave"] == pytest.approx([0.5, 0.4])
    # A worker killed between two batches (as the out-of-memory killer would) is replaced before
    # the next one, no call charged.
    restarts = pool.restarts
    os.kill(pool.workers[0].process.pid, signal.SIGKILL)
    pool.workers[0].process.wait()
    scores = pool.score(["ok", "fine"], ["ok", "no"], [{}, {}])
    assert scores.per_reward["exact_match"] == [1.0, 0.0]
    assert not any(scores.failures.values())
    assert pool.restarts == restarts + 1
    with pytest.raises(ValueError, match="one answer and one sample per completion"):
        pool.score(["a"], ["a", "b"], [{}])
    with pytest.raises(ValueError, match="completion 1: .* got str, int and dict"):
        pool.score(["a", "b"], ["a", 42], [{}, {}])


def test_a_worker_imports_no_torch_and_closing_leaves_no_process(user_module_on_path):
    assert "torch" in sys.modules and torch is not None
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    with RewardWorkers([{"name": f"{USER_MODULE}:torch_imported"}], workers=2, timeout_s=5.0) as workers:
        worker_pids = {worker.process.pid for worker in workers.workers}
        scores = workers.score(["a", "b", "c"], ["", "", ""], [{}, {}, {}])
        assert scores.per_reward[f"{USER_MODULE}:torch_imported"] == [0.0, 0.0, 0.0]
        assert worker_pids <= {child.pid for child in psutil.Process().children(recursive=True)}
    children_after = {child.pid for child in psutil.Process().children(recursive=True)}
    assert children_after <= children_before
    assert not any(psutil.pid_exists(pid) for pid in worker_pids)


def test_a_worker_that_cannot_load_a_reward_stops_the_start_with_the_reason():
    with pytest.raises(RuntimeError, match="cannot import module 'no_such_module_xyz'"):
        RewardWorkers([{"name": "no_such_module_xyz:score"}], workers=1)


def test_a_batch_that_cannot_be_sent_closes_the_pool():
    workers = RewardWorkers([{"name": "exact_match"}], workers=1)
    pid = workers.workers[0].process.pid
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        workers.score(["a"], ["a"], [{"not plain": lambda: 0}])
    assert not psutil.pid_exists(pid)
    with pytest.raises(RuntimeError, match="closed"):
        workers.score(["a"], ["a"], [{}])


def test_a_user_reward_name_that_does_not_resolve_is_refused_by_its_key(user_module_on_path):
    key = "train.stages.rl.grpo.rewards"
    with pytest.raises(ConfigError) as refused:
        check_rewards([{"name": "format"}, {"name": f"{USER_MODULE}:no_such_reward"}], key)
    assert refused.value.key == f"{key}[1].name"
    assert f"module '{USER_MODULE}' has no attribute 'no_such_reward'" in str(refused.value)

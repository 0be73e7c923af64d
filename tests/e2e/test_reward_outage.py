"""A run that can always finish once its reward answers: a step whose samples are all excluded
says which reward excluded how many and why, keeps nothing of that scoring, and scores again on the rerun; an
optional reward that is down is left out while another component remains."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.engines.reward.base import RewardError
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.flows.train import train

FAST = "retries: 0, backoff_s: 0.01, timeout_s: 5"


class Scorer:
    """A user's scorer service on loopback: answers `self.answer` (bytes, or a function of the request's number) to
    every POST and counts them; after `fail_after` requests it answers 503."""

    def __init__(self):
        self.answer, self.requests, self.fail_after = b'{"score": 0.5}', 0, None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server naming
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.requests += 1
                failing = owner.fail_after is not None and owner.requests > owner.fail_after
                answer = owner.answer(owner.requests) if callable(owner.answer) else owner.answer
                self.send_response(503 if failing else 200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"


@pytest.fixture
def scorer():
    server = Scorer()
    yield server
    server.server.shutdown()
    server.server.server_close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/score"


def _run(url: str, *more: str) -> list[str]:
    judge = "{name: http_scorer, options: {url: '%s', %s}}" % (url, FAST)
    return TINY + ["run.steps=1", "data.num_val_prompts=0", f"reward.components=[{judge}]", *more]


def test_a_step_with_nothing_scored_names_the_reward_and_scores_again_once_it_answers(workdir, scorer):
    """The judge answers garbage: the error names the reward, the count and the reason, nothing of the failed
    scoring is kept (stored, it would outlive a rerun that trains on new scores), and the rerun asks the judge
    again."""
    scorer.answer = b'{"score": "garbage"}'
    with pytest.raises(
        RewardError,
        match=r"step 1 chunk 0: 4 of 4 samples excluded by the reward: http_scorer excluded 4 \(error: malformed: "
        r"no finite number under 'score' in \"\{'score': 'garbage'\}\"\)",
    ):
        train(config=None, overrides=_run(scorer.url))
    store = TrajectoryStore("runs/quickstart/trajectories.lance")
    assert not store.read_rewards(0, allow_missing=True)[2].any()  # nothing of the failed scoring was stored
    scorer.answer, scorer.requests = b'{"score": 0.5}', 0
    assert train(config=None, overrides=_run(scorer.url))["last_step"] == 1
    assert scorer.requests == 8  # every sample of the step was scored again
    rewards, _, valid = store.read_rewards(0)
    assert valid.all() and rewards.tolist() == [0.5] * 8


def test_nan_answers_are_a_step_with_nothing_scored_too(workdir, scorer):
    scorer.answer = b'{"score": NaN}'
    with pytest.raises(RewardError, match=r"http_scorer excluded 4 \(error: .*no finite number .*'score': nan"):
        train(config=None, overrides=_run(scorer.url))


def test_an_optional_reward_that_is_down_is_left_out_while_another_remains(workdir):
    """The optional judge is down for the whole run (nothing listens): the required jpeg reward alone scores the
    step. With no other component, every sample is excluded and the error says so."""
    judge = "{name: http_scorer, required: false, options: {url: '%s', %s}}" % (_dead_url(), FAST)
    both = TINY + ["run.steps=1", "reward.components=[{name: jpeg_compressibility}, %s]" % judge]
    assert train(config=None, overrides=both)["last_step"] == 1
    metrics = _metrics(workdir)
    assert metrics["critic/rewards/mean"] == pytest.approx(metrics["reward/jpeg_compressibility"])
    assert metrics["reward/excluded"] == 0
    alone = TINY + ["run.steps=1", "run.name=alone", "data.num_val_prompts=0", "reward.components=[%s]" % judge]
    with pytest.raises(RewardError, match=r"not required: it was down and no other component remained"):
        train(config=None, overrides=alone)


def test_a_judge_down_for_part_of_a_step_is_left_out_of_all_of_it(workdir, scorer):
    """The optional judge answers the first chunk (4 samples) and then fails: the step's totals leave it out for
    every sample, not only the second chunk's (a group's samples stay comparable), and MLflow records it."""
    scorer.fail_after = 4
    judge = "{name: http_scorer, weight: 10.0, required: false, options: {url: '%s', %s}}" % (scorer.url, FAST)
    run = TINY + ["run.steps=1", "data.num_val_prompts=0"]
    assert train(config=None, overrides=run + ["reward.components=[{name: jpeg_compressibility}, %s]" % judge])
    metrics = _metrics(workdir)
    assert metrics["reward/left_out/http_scorer"] == 1.0 and metrics["reward/http_scorer"] == 0.5
    assert metrics["critic/rewards/mean"] == pytest.approx(metrics["reward/jpeg_compressibility"])


def test_excluded_samples_are_stored_as_nan_advantages_not_0(workdir, scorer):
    """Every other answer is garbage: those samples are excluded. advantages.lance holds NaN for them (not trained
    on; 0.0 would read as a sample exactly at its group's mean), the others finite."""
    scorer.answer = lambda n: b'{"score": "garbage"}' if n % 2 else b'{"score": %d}' % n
    assert train(config=None, overrides=_run(scorer.url))["last_step"] == 1
    store = TrajectoryStore("runs/quickstart/trajectories.lance")
    _, _, valid = store.read_rewards(0)
    advantages = store.read_advantages(0)
    assert int(valid.sum()) == 4
    assert advantages[~valid].isnan().all() and advantages[valid].isfinite().all()


def _metrics(workdir) -> dict[str, float]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    return run.data.metrics

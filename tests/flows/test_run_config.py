"""The overrides `diffrl train` hands Prefect as the train flow's parameters (stored in its database) hold no secret,
and the flow gets the real ones back (diffrl/flows/run_config.py)."""

from __future__ import annotations

from diffrl.flows.run_config import held_overrides, hold_overrides, recorded_override


def test_secret_override_values_are_recorded_as_stars():
    assert recorded_override("reward.http_scorer.api_key=sk-123") == "reward.http_scorer.api_key=***"
    assert recorded_override("run.storage_options={key: AKIA1, secret: s3cr3t, aws_region: eu}") == (
        "run.storage_options={aws_region: eu, key: '***', secret: '***'}"
    )
    assert recorded_override("model.path=https://user:tok@host/m") == "model.path=https://***@host/m"
    assert recorded_override("data.val=s3://b/p.jsonl?token=abc&x=1") == "data.val=s3://b/p.jsonl?token=***&x=1"
    for plain in ("train.lr=7.0e-4", "run.name=x", "reward.http_scorer.api_key_env=MY_KEY", "train.lr=[1,"):
        assert recorded_override(plain) == plain  # nothing to hide (a variable's name, a value the loader refuses)


def test_the_flow_gets_the_real_overrides_back():
    real = ["run.name=s", "run.storage_options={token: t-9}"]
    recorded = hold_overrides(real)
    assert recorded == ["run.name=s", "run.storage_options={token: '***'}"]
    assert held_overrides(recorded) == real
    assert held_overrides(["run.name=other"]) == ["run.name=other"]  # a deployment's stored parameters, as given

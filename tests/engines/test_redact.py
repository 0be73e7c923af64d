"""What diffrl records has no secrets (diffrl/engines/redact.py): URL credentials, secret-like query parameters and
the values under secret-like keys become ***; everything else is kept as it was."""

from __future__ import annotations

import pytest

from diffrl.engines.redact import MASK, is_secret_name, redact, redact_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://user:TOKEN@example.com/x.git", "https://***@example.com/x.git"),
        ("https://TOKEN@github.com/team/x", "https://***@github.com/team/x"),
        ("s3://AKIA:SECRET@bucket/runs", "s3://***@bucket/runs"),
        ("judge at http://u:p@127.0.0.1:8000/v1 failed", "judge at http://***@127.0.0.1:8000/v1 failed"),
        ("https://h/score?token=TOKEN&page=2", "https://h/score?token=***&page=2"),
        (
            "https://acct.blob.core.windows.net/c?sv=2024&sig=SIG&se=1",
            "https://acct.blob.core.windows.net/c?sv=2024&sig=***&se=1",
        ),
        # nothing secret: kept as it was
        ("git@github.com:team/x.git", "git@github.com:team/x.git"),
        ("http://127.0.0.1:8000/v1?page=2", "http://127.0.0.1:8000/v1?page=2"),
        ("write to a@b.c", "write to a@b.c"),
    ],
)
def test_redact_text_removes_url_credentials_and_secret_parameters(text, expected):
    assert redact_text(text) == expected


def test_secret_names_are_the_storage_and_api_credentials_only():
    secret = ["key", "secret", "token", "aws_secret_access_key", "aws_access_key_id", "aws_session_token"]
    secret += ["account_key", "sas_token", "password", "api_key", "apiKey", "hf_token", "X-Amz-Signature"]
    kept = ["api_key_env", "score_key", "info_key", "max_tokens", "max_new_tokens", "tokenizer", "region"]
    kept += ["endpoint_url", "client_kwargs", "anon", "keep_versions", "key_file"]
    assert [n for n in secret if not is_secret_name(n)] == [] and [n for n in kept if is_secret_name(n)] == []


def test_redact_masks_set_values_under_secret_keys_at_any_depth():
    config = {
        "run": {"storage_options": {"key": "AKIA", "secret": "SK", "token": None, "region": "eu-west-1"}},
        "data": {"train": "https://user:TOKEN@example.com/p.jsonl", "num_generated": 3},
        "components": [{"options": {"api_key_env": "JUDGE_KEY", "client_kwargs": {"endpoint_url": "http://u:p@m"}}}],
        "shape": (1, 2),
    }
    assert redact(config) == {
        "run": {"storage_options": {"key": MASK, "secret": MASK, "token": None, "region": "eu-west-1"}},
        "data": {"train": "https://***@example.com/p.jsonl", "num_generated": 3},
        "components": [{"options": {"api_key_env": "JUDGE_KEY", "client_kwargs": {"endpoint_url": "http://***@m"}}}],
        "shape": (1, 2),
    }
    assert config["run"]["storage_options"]["key"] == "AKIA"  # a copy: the run still has its credentials

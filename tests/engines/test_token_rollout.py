"""Token rollout (diffrl.engines.rollout.tokens) into the token trajectory table (diffrl.engines.store.tokens): the
tiny Qwen3-Omni Thinker samples with images into a real Lance table; rows read back padded equal what was sampled,
and the stored log-probs equal the replay of the stored tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engines.rollout.tokens import TransformersTokenEngine
from diffrl.engines.store.tokens import TokenTrajectoryTable
from diffrl.models.causal_lm import CausalLMPolicy, PromptInputs, SamplingParams, TokenPrompt
from diffrl.models.tiny import build_tiny


def test_rollout_rows_round_trip_and_replay(tmp_path):
    policy = CausalLMPolicy.from_pretrained(build_tiny("qwen3_omni", str(tmp_path / "thinker"), seed=0))
    image = str(tmp_path / "scene.png")
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image)
    table = TokenTrajectoryTable(str(tmp_path / "tokens.lance"))
    engine = TransformersTokenEngine(policy, table)
    engine.update_weights(3)
    prompts = [TokenPrompt("how many circles?", (image,)), TokenPrompt("a red square")]
    params = SamplingParams(n=2, max_tokens=5, seed=7)
    result = engine.generate(4, prompts, ["q1", "q0"], params)
    assert (result.step, result.rows, result.policy_version) == (4, 4, 3)
    assert 1 <= result.metrics["response_length/mean"] <= 5 and 0 <= result.metrics["response_length/clip_ratio"] <= 1

    rows = table.read(4)
    assert rows.group_ids == ["q0", "q0", "q1", "q1"] and rows.sample_index == [0, 1, 0, 1]
    assert rows.policy_version == [3] * 4 and rows.images == [(), (), (image,), (image,)]
    again = policy.sample(prompts, params)  # seeded: the same samples, rows q1 first
    order = [2, 3, 0, 1]
    for i, j in enumerate(order):
        n = int(again.lengths[j])
        assert rows.lengths[i] == n
        assert rows.response_ids[i, :n].tolist() == again.response_ids[j, :n].tolist()
        torch.testing.assert_close(rows.log_probs[i, :n], again.log_probs[j, :n])
        prompt = rows.prompt_ids[i][rows.prompt_mask[i]]
        assert prompt.tolist() == again.prompts.input_ids[j][again.prompts.attention_mask[j].bool()].tolist()
    # replay the stored q1 rows (the image prompt): inputs rebuilt from the stored ids and image path
    encoded = policy.encode([TokenPrompt(rows.prompts[2], rows.images[2])]).repeat(2)
    inputs = PromptInputs(rows.prompt_ids[2:], rows.prompt_mask[2:].long(), encoded.vision)
    with torch.no_grad():
        replay = policy.log_probs(inputs, rows.response_ids[2:])
    torch.testing.assert_close(replay * rows.mask[2:], rows.log_probs[2:], rtol=0, atol=1e-5)


def test_table_checks_its_rows(tmp_path):
    table = TokenTrajectoryTable(str(tmp_path / "t.lance"))
    with pytest.raises(ValueError, match="one value per response token"):
        table.write(
            0,
            ["g"],
            [0],
            policy_version=0,
            prompts=["p"],
            images=[()],
            prompt_ids=[[1]],
            response_ids=[[2, 3]],
            log_probs=[[-1.0]],
        )
    with pytest.raises(ValueError, match="no token trajectories for step 0"):
        table.read(0)

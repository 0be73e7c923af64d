"""GSPO on tokens (diffrl.algorithms.gspo) against the hand-written closed form: the sequence ratio
s_i = exp(mean over response tokens of (log pi - log pi_old)), clipped, and its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.batches import TokenBatch
from diffrl.algorithms.gspo import GSPO, gspo_loss

D = torch.float64
LOG_PROBS = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]]
OLD = [[-1.1, -1.9, -0.6], [-0.3, -0.8, -1.0]]
MASK = [[1, 1, 1], [1, 1, 0]]  # the second response has 2 tokens; its third entry is padding
ADVANTAGES = [1.0, -2.0]


def _batch() -> TokenBatch:
    return TokenBatch(
        log_probs=torch.tensor(LOG_PROBS, dtype=D, requires_grad=True),
        old_log_probs=torch.tensor(OLD, dtype=D),
        mask=torch.tensor(MASK),
        advantages=torch.tensor(ADVANTAGES, dtype=D),
    )


def test_gspo_loss_closed_form_with_the_papers_clip():
    """Clip range [1 - 3e-4, 1 + 4e-4]: both sequences' ratios lie outside it."""
    batch = _batch()
    loss, metrics = GSPO("gspo").loss(batch)
    s0 = math.exp((0.1 - 0.1 + 0.1) / 3)  # 1.0339: A > 0, clipped at 1 + 4e-4
    s1 = math.exp((0.0 + 0.1) / 2)  # 1.0513 (the padded token is ignored): A < 0, the unclipped term is larger
    l0 = max(-1.0 * s0, -1.0 * (1 + 4e-4))
    l1 = max(2.0 * s1, 2.0 * (1 + 4e-4))
    assert l0 == -(1 + 4e-4) and l1 == 2.0 * s1
    assert loss.item() == pytest.approx((l0 + l1) / 2, abs=1e-12)
    loss.backward()
    # d loss / d log_probs_1t = (1/B) (-A_1) s_1 / |y_1| on response tokens; 0 for the clipped sequence and padding
    expected = torch.tensor([[0.0, 0.0, 0.0], [2.0 * s1 / 2 / 2, 2.0 * s1 / 2 / 2, 0.0]], dtype=D)
    torch.testing.assert_close(batch.log_probs.grad, expected, rtol=0, atol=1e-12)
    assert metrics["actor/pg_clipfrac"].item() == 1.0  # both ratios outside the range
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-(math.log(s0) + math.log(s1)) / 2, abs=1e-12)
    assert metrics["actor/ratio_mean"].item() == pytest.approx((s0 + s1) / 2, abs=1e-12)
    assert metrics["actor/ratio_std"].item() == pytest.approx(abs(s0 - s1) / 2, abs=1e-12)


def test_gspo_gradient_is_the_sequence_ratios_when_nothing_is_clipped():
    batch = _batch()
    loss, metrics = gspo_loss(
        batch.log_probs, batch.old_log_probs, batch.mask, batch.advantages, clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    s = [math.exp(0.1 / 3), math.exp(0.1 / 2)]
    assert loss.item() == pytest.approx((-1.0 * s[0] + 2.0 * s[1]) / 2, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.0 * s[0] / 3 / 2] * 3, [2.0 * s[1] / 2 / 2] * 2 + [0.0]], dtype=D)
    torch.testing.assert_close(batch.log_probs.grad, expected, rtol=0, atol=1e-12)
    assert metrics["actor/pg_clipfrac"].item() == 0.0


def test_gspo_ratio_is_per_sequence_not_per_token():
    """Only the mean log-ratio of a sequence matters: moving log-prob between its tokens, or changing padding,
    leaves the loss unchanged (a token-level ratio would change)."""
    base = gspo_loss(*_tensors(LOG_PROBS), clip_ratio_low=0.2, clip_ratio_high=0.2)[0]
    shifted = [[-1.0 + 0.05, -2.0 - 0.05, -0.5], [-0.3, -0.7, 3.0]]
    moved = gspo_loss(*_tensors(shifted), clip_ratio_low=0.2, clip_ratio_high=0.2)[0]
    assert moved.item() == pytest.approx(base.item(), abs=1e-12)


def _tensors(log_probs):
    return (
        torch.tensor(log_probs, dtype=D),
        torch.tensor(OLD, dtype=D),
        torch.tensor(MASK),
        torch.tensor(ADVANTAGES, dtype=D),
    )


def test_gspo_declares_token_needs_and_checks_its_inputs():
    algo = GSPO("gspo")
    assert algo.needs.data == "tokens" and algo.needs.old_log_probs and not algo.needs.reference
    assert (algo.clip_ratio_low, algo.clip_ratio_high, algo.global_std, algo.adv_std_ddof) == (3e-4, 4e-4, False, 1)
    with pytest.raises(ValueError, match="clip_ratio_low must be > 0"):
        GSPO("gspo", clip_ratio_low=0.0)
    with pytest.raises(ValueError, match=r"must be \(B, T\)"):
        gspo_loss(
            torch.zeros(3), torch.zeros(3), torch.ones(3), torch.zeros(1), clip_ratio_low=0.2, clip_ratio_high=0.2
        )

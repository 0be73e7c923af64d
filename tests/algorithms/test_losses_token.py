"""Token losses (diffrl.algorithms.losses_token) and the token algorithms (diffrl.algorithms.token_pg) against the
papers' formulas written out by hand in Python floats, in fp64: GRPO's token surrogate and KL, DAPO's clip-higher,
token-mean, overlong shaping and dynamic sampling, Dr.GRPO's aggregation, DPO on sequences."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.advantages import group_advantages
from diffrl.algorithms.base import Needs
from diffrl.algorithms.batches import TokenBatch
from diffrl.algorithms.losses_token import (
    aggregate_tokens,
    nonconstant_groups,
    overlong_penalty,
    sequence_dpo_loss,
    token_clip_loss,
    token_kl,
)
from diffrl.algorithms.token_pg import DAPO, SequenceDPO, TokenGRPO

D = torch.float64
LOG_PROBS = [[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.5, -9.0, -9.0]]
# token ratios: e^0.25 = 1.284, e^-0.3 = 0.741, e^0.1, e^0; e^0.22 = 1.246, e^0 (then padding)
OLD = [[-1.25, -1.7, -0.6, -0.1], [-0.52, -0.5, -1.0, -1.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0]]  # the second response has 2 tokens, then padding
ADVANTAGES = [1.5, -0.5]


def _reference_per_token(lo: float, hi: float) -> list[list[float | None]]:
    """max(-A r, -A clip(r, 1 - lo, 1 + hi)) per response token; None on padding."""
    out = []
    for lp_row, old_row, m_row, a in zip(LOG_PROBS, OLD, MASK, ADVANTAGES):
        row = []
        for lp, old, m in zip(lp_row, old_row, m_row):
            r = math.exp(lp - old)
            row.append(max(-a * r, -a * min(max(r, 1 - lo), 1 + hi)) if m else None)
        out.append(row)
    return out


def _aggregate(per_token: list[list[float | None]], mode: str, length: int = 4) -> float:
    rows = [[x for x in row if x is not None] for row in per_token]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * length)


def _batch(**kw) -> TokenBatch:
    return TokenBatch(
        log_probs=torch.tensor(LOG_PROBS, dtype=D, requires_grad=True),
        old_log_probs=torch.tensor(OLD, dtype=D),
        mask=torch.tensor(MASK),
        advantages=torch.tensor(ADVANTAGES, dtype=D),
        **kw,
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregations_closed_form(mode):
    per_token = [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0]]  # padding values must not count
    got = aggregate_tokens(torch.tensor(per_token, dtype=D), torch.tensor(MASK), mode, norm_length=8)
    expected = {"token-mean": 40.0 / 6, "seq-mean-token-mean": (10.0 / 4 + 30.0 / 2) / 2}.get(mode, 40.0 / (2 * 8))
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_grpo_token_loss_closed_form_and_gradient():
    """GRPO (eq. 3): clip 0.2 both sides, per-sequence token mean then mean over sequences."""
    batch = _batch()
    loss, metrics = TokenGRPO("grpo").loss(batch)
    per_token = _reference_per_token(0.2, 0.2)
    assert loss.item() == pytest.approx(_aggregate(per_token, "seq-mean-token-mean"), abs=1e-12)
    loss.backward()
    # d l_it / d log_probs_it = -A_i r_it where the unclipped term is the max, else 0; times 1 / (B |y_i|)
    grad = [[0.0] * 4 for _ in range(2)]
    clipped = 0
    for i in range(2):
        n = sum(MASK[i])
        for t in range(4):
            if not MASK[i][t]:
                continue
            r, a = math.exp(LOG_PROBS[i][t] - OLD[i][t]), ADVANTAGES[i]
            inside = 0.8 <= r <= 1.2
            clipped += not inside
            active = inside or (-a * r > -a * min(max(r, 0.8), 1.2))
            grad[i][t] = -a * r / (2 * n) if active else 0.0
    torch.testing.assert_close(batch.log_probs.grad, torch.tensor(grad, dtype=D), rtol=0, atol=1e-12)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(clipped / 6, abs=1e-12)
    log_ratios = [LOG_PROBS[i][t] - OLD[i][t] for i in range(2) for t in range(4) if MASK[i][t]]
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-sum(log_ratios) / 6, abs=1e-12)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(sum(map(math.exp, log_ratios)) / 6, abs=1e-12)


def test_dapo_clip_higher_and_token_mean():
    """DAPO (eq. 8): clip 0.2 below, 0.28 above, every token weighted equally across sequences."""
    batch = _batch()
    loss, metrics = DAPO("dapo").loss(batch)
    assert loss.item() == pytest.approx(_aggregate(_reference_per_token(0.2, 0.28), "token-mean"), abs=1e-12)
    # ratios e^0.25 = 1.284 and e^0.22 = 1.246 lie above 1.2; only 1.284 lies above 1.28 (e^-0.3 = 0.741 below 0.8)
    assert metrics["actor/pg_clipfrac_higher"].item() == pytest.approx(1 / 6, abs=1e-12)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 6, abs=1e-12)
    grpo_higher = token_clip_loss(
        batch.log_probs,
        batch.old_log_probs,
        batch.mask,
        batch.advantages,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        aggregation="token-mean",
    )[1]["actor/pg_clipfrac_higher"]
    assert grpo_higher.item() == pytest.approx(2 / 6, abs=1e-12)


def test_dr_grpo_divides_by_a_constant_length_and_skips_the_std():
    batch = _batch()
    algo = TokenGRPO("dr_grpo", norm_by_std=False, aggregation="seq-mean-token-sum-norm", norm_length=16)
    loss, _ = algo.loss(batch)
    assert loss.item() == pytest.approx(_aggregate(_reference_per_token(0.2, 0.2), "sum-norm", 16), abs=1e-12)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D)
    advantages = group_advantages(rewards, [0, 0, 0, 0], norm_by_std=algo.norm_by_std, global_std=algo.global_std)
    torch.testing.assert_close(advantages, torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=D), rtol=0, atol=1e-12)


def test_grpo_kl_is_k3_to_the_reference():
    """eq. 4: pi_ref / pi - log(pi_ref / pi) - 1 per token, gradient 1 - pi_ref / pi."""
    ref = [[-1.1, -2.0, -0.4, -0.3], [-0.2, -0.9, 0.0, 0.0]]
    lp = torch.tensor(LOG_PROBS, dtype=D, requires_grad=True)
    kl = token_kl(lp, torch.tensor(ref, dtype=D))
    for i in range(2):
        for t in range(4):
            d = ref[i][t] - LOG_PROBS[i][t]
            assert kl[i, t].item() == pytest.approx(math.exp(d) - d - 1, abs=1e-12)
    kl.sum().backward()
    expected = [[1 - math.exp(ref[i][t] - LOG_PROBS[i][t]) for t in range(4)] for i in range(2)]
    torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=D), rtol=0, atol=1e-12)
    batch = _batch(ref_log_probs=torch.tensor(ref, dtype=D))
    with_kl, metrics = TokenGRPO("grpo", kl_coef=0.04).loss(batch)
    k3 = [
        [math.exp(ref[i][t] - LOG_PROBS[i][t]) - (ref[i][t] - LOG_PROBS[i][t]) - 1 for t in range(4)] for i in range(2)
    ]
    kl_value = (sum(k3[0]) / 4 + sum(k3[1][:2]) / 2) / 2  # aggregated like the surrogate: seq-mean-token-mean
    assert metrics["actor/kl_loss"].item() == pytest.approx(kl_value, abs=1e-12)
    expected_loss = _aggregate(_reference_per_token(0.2, 0.2), "seq-mean-token-mean") + 0.04 * kl_value
    assert with_kl.item() == pytest.approx(expected_loss, abs=1e-12)
    assert TokenGRPO("grpo", kl_coef=0.04).needs.reference and not TokenGRPO("grpo").needs.reference


def test_rollout_correction_weights_multiply_each_token():
    weights = torch.tensor([[1.0, 0.5, 2.0, 1.0], [0.0, 1.0, 1.0, 1.0]], dtype=D)
    loss, _ = DAPO("dapo").loss(_batch(weights=weights))
    per_token = _reference_per_token(0.2, 0.28)
    weighted = [
        [None if x is None else x * w for x, w in zip(row, wrow)] for row, wrow in zip(per_token, weights.tolist())
    ]
    assert loss.item() == pytest.approx(_aggregate(weighted, "token-mean"), abs=1e-12)


def test_overlong_penalty_eq_13():
    """L_max 10, L_cache 4: 0 up to 6 tokens, linear to -1 at 10, -1 beyond."""
    lengths = torch.tensor([3, 6, 7, 8, 10, 11])
    got = overlong_penalty(lengths, max_response_length=10, overlong_buffer=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    shaped = DAPO("dapo", overlong_buffer=4, overlong_penalty_factor=0.5).shape_rewards(
        torch.ones(6, dtype=D), lengths, 10
    )
    torch.testing.assert_close(shaped, torch.tensor([1.0, 1.0, 0.875, 0.75, 0.5, 0.5], dtype=D), rtol=0, atol=1e-12)
    assert torch.equal(DAPO("dapo").shape_rewards(torch.ones(2), torch.tensor([99, 1]), 10), torch.ones(2))
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(lengths, max_response_length=4, overlong_buffer=8)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    expected = [False, False, True, True, False, False, False, False]
    assert nonconstant_groups(rewards, groups).tolist() == expected
    assert DAPO("dapo").keep(rewards, groups).tolist() == expected
    assert DAPO("dapo", dynamic_sampling=False).keep(rewards, groups).all()


def test_sequence_dpo_closed_form():
    """eq. 7: -log sigmoid(beta ((log pi_w - log ref_w) - (log pi_l - log ref_l))) on summed token log-probs."""
    ref = [[-1.0, -1.0, -1.0, -1.0], [-0.1, -0.2, -5.0, -5.0]]
    batch = _batch(ref_log_probs=torch.tensor(ref, dtype=D))
    algo = SequenceDPO("dpo_seq", beta=0.1)
    loss, metrics = algo.loss(batch)
    pi_w, pi_l = sum(LOG_PROBS[0]), sum(LOG_PROBS[1][:2])
    ref_w, ref_l = sum(ref[0]), sum(ref[1][:2])
    z = 0.1 * ((pi_w - ref_w) - (pi_l - ref_l))
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-z))), abs=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * (pi_w - ref_w), abs=1e-12)
    assert metrics["rewards/margins"].item() == pytest.approx(z, abs=1e-12)
    loss.backward()
    # d loss / d log pi(y_w) = -beta (1 - sigmoid(z)) on every chosen token
    g = -0.1 * (1 - 1 / (1 + math.exp(-z)))
    torch.testing.assert_close(
        batch.log_probs.grad, torch.tensor([[g] * 4, [-g, -g, 0, 0]], dtype=D), rtol=0, atol=1e-12
    )
    direct, _ = sequence_dpo_loss(
        torch.tensor([pi_w], dtype=D),
        torch.tensor([pi_l], dtype=D),
        torch.tensor([ref_w], dtype=D),
        torch.tensor([ref_l], dtype=D),
        beta=0.1,
    )
    assert direct.item() == pytest.approx(loss.item(), abs=1e-12)
    assert algo.needs.pairs and algo.needs.reference and algo.needs.data == "tokens"


def test_token_algorithms_defaults_and_errors():
    grpo, dapo = TokenGRPO("grpo"), DAPO("dapo")
    assert (grpo.clip_ratio_low, grpo.clip_ratio_high, grpo.aggregation) == (0.2, 0.2, "seq-mean-token-mean")
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high, dapo.aggregation, dapo.kl_coef) == (0.2, 0.28, "token-mean", 0)
    assert dapo.needs == Needs("tokens", old_log_probs=True, varied_groups=True)  # dynamic sampling on by default
    with pytest.raises(ValueError, match="aggregation must be one of"):
        TokenGRPO("grpo", aggregation="sum")
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        TokenGRPO("grpo", kl_coef=-1.0)
    with pytest.raises(ValueError, match="ref_log_probs"):
        TokenGRPO("grpo", kl_coef=0.1).loss(_batch())
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        token_clip_loss(
            torch.zeros(3),
            torch.zeros(3),
            torch.ones(3),
            torch.zeros(1),
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            aggregation="token-mean",
        )

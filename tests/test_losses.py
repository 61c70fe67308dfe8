"""losses.py against hand-computed values, edge cases, gradients and invariants."""

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo import nonzero_std_groups
from losses import (
    agg_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
)

T = torch.tensor


# ---------------------------------------------------------------- masked_mean / agg_loss
def test_masked_mean_ignores_masked_values_even_nan():
    assert masked_mean(T([1.0, 2.0, 3.0]), T([1.0, 1.0, 0.0])).item() == pytest.approx(1.5)
    assert masked_mean(T([1.0, float("nan")]), T([1.0, 0.0])).item() == pytest.approx(1.0)
    assert masked_mean(T([[1.0, 3.0], [5.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]]), dim=-1).tolist() == pytest.approx(
        [2.0, 5.0]
    )
    assert masked_mean(T([4.0]), T([0.0])).item() == 0.0  # + 1e-8: empty mask gives 0, not NaN


VALUES = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row fully masked


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", (3 + 4) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", 3.5 / 3),  # / T (max response length)
        ("token-sum", 7.0),  # 1 + 2 + 4: no normaliser
    ],
)
def test_agg_loss_modes_hand_computed(mode, expected):
    assert agg_loss(VALUES, MASK, mode).item() == pytest.approx(expected, rel=1e-6)


def test_agg_loss_global_counts_and_scale_factor():
    assert agg_loss(VALUES, MASK, "token-mean", num_tokens=6).item() == pytest.approx(7 / 6)
    assert agg_loss(VALUES, MASK, "token-sum", num_tokens=6, num_seqs=4).item() == 7.0  # counts play no part
    assert agg_loss(VALUES, MASK, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(7 / 4)
    assert agg_loss(VALUES, MASK, "seq-mean-token-mean", num_seqs=5).item() == pytest.approx(5.5 / 5)
    assert agg_loss(VALUES, MASK, "seq-mean-token-sum-norm", scale_factor=7).item() == pytest.approx(0.5)
    assert agg_loss(VALUES, MASK, "seq-mean-token-sum-norm", num_seqs=1, scale_factor=7).item() == pytest.approx(1.0)


def test_agg_loss_all_masked_is_zero_not_nan():
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert agg_loss(VALUES, torch.zeros_like(MASK), mode).item() == 0.0


def test_micro_batches_with_global_count_sum_to_the_full_batch_mean():
    """The bug class of per-micro-batch normalisation: unequal micro-batches must not change the result."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10, generator=g)
    lengths = T([10, 1, 1, 2, 9, 3])
    mask = (torch.arange(10)[None] < lengths[:, None]).float()
    full = agg_loss(x, mask, "token-mean")
    n = mask.sum()
    parts = [agg_loss(x[a:b], mask[a:b], "token-mean", num_tokens=n) for a, b in [(0, 1), (1, 4), (4, 6)]]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-6)
    per_micro_mean = sum(agg_loss(x[a:b], mask[a:b]) for a, b in [(0, 1), (1, 4), (4, 6)]) / 3
    assert abs(per_micro_mean.item() - full.item()) > 1e-3  # the wrong way is detectably wrong
    seqs = (mask.sum(-1) > 0).sum()
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        parts = [agg_loss(x[a:b], mask[a:b], mode, num_seqs=seqs) for a, b in [(0, 1), (1, 4), (4, 6)]]
        assert sum(parts).item() == pytest.approx(agg_loss(x, mask, mode).item(), rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.floats(-100, 100), st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_property_aggregating_a_constant_gives_the_constant(c, lengths):
    mask = (torch.arange(8)[None] < T(lengths)[:, None]).double()
    x = torch.full(mask.shape, c, dtype=torch.float64)
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert agg_loss(x, mask, mode).item() == pytest.approx(c, abs=1e-6)
    expected_sum = c * sum(lengths) / len(lengths)
    assert agg_loss(x, mask, "seq-mean-token-sum").item() == pytest.approx(expected_sum, abs=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: agg_loss(VALUES, MASK, "sum"), "token-mean, token-sum, seq-mean-token-sum"),
        (lambda: agg_loss(VALUES, MASK[:2]), "shapes must match"),
        (lambda: agg_loss(VALUES[0], MASK[0]), r"\[batch, tokens\]"),
        (lambda: masked_mean(VALUES, MASK[:, :2]), "shapes must match"),
    ],
)
def test_agg_loss_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- GRPO advantages
def test_grpo_hand_computed_group():
    adv = grpo_advantages(T([1.0, 0.0, 1.0]), [0, 0, 0])
    assert adv.tolist() == pytest.approx([0.5774, -1.1547, 0.5774], abs=1e-4)
    # unbiased std: mean 2/3, std sqrt(1/3)
    assert adv[1].item() == pytest.approx(-(2 / 3) / (math.sqrt(1 / 3) + 1e-6), rel=1e-6)


def test_grpo_edge_cases():
    assert grpo_advantages(T([0.7]), ["only"]).item() == pytest.approx(0.7 / (1 + 1e-6))  # size-1 group
    assert grpo_advantages(T([1.0, 1.0, 1.0, 1.0]), [5] * 4).tolist() == [0.0] * 4  # identical
    assert grpo_advantages(T([1.0, 0.0, 1.0]), "aaa", norm_by_std=False).tolist() == pytest.approx(
        [1 / 3, -2 / 3, 1 / 3]
    )
    assert grpo_advantages([1, 0], ["a", "a"]).dtype == torch.float32  # python ints accepted


def test_grpo_groups_are_by_id_not_position():
    rewards = T([1.0, 5.0, 0.0, 7.0, 1.0, 6.0])
    ids = [("p", 0), ("p", 1), ("p", 0), ("p", 1), ("p", 0), ("p", 1)]  # interleaved, tuple ids
    adv = grpo_advantages(rewards, ids)
    assert adv[[0, 2, 4]].tolist() == pytest.approx(grpo_advantages(T([1.0, 0.0, 1.0]), [0] * 3).tolist())
    assert adv[[1, 3, 5]].tolist() == pytest.approx(grpo_advantages(T([5.0, 7.0, 6.0]), [0] * 3).tolist())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=8), min_size=1, max_size=5))
def test_property_grpo_matches_statistics_module_and_sums_to_zero(groups):
    rewards = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    adv = grpo_advantages(rewards, ids)
    k = 0
    for g in groups:
        mean, std = statistics.mean(g), statistics.stdev(g)
        expected = [(r - mean) / (std + 1e-6) for r in g]
        assert adv[k : k + len(g)].tolist() == pytest.approx(expected, abs=1e-5)
        assert abs(sum(adv[k : k + len(g)].tolist())) < 1e-4
        k += len(g)


def test_grpo_bad_input():
    with pytest.raises(ValueError, match="3 rewards but 2 group_ids"):
        grpo_advantages(T([1.0, 0.0, 1.0]), [0, 0])
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.ones(2, 2), [0, 0])


# ---------------------------------------------------------------- policy loss
def policy_term(logp, old, adv, mask, is_weights=None, agg_mode="token-mean", num_tokens=None, **clips):
    """The caller's side, as grpo.policy_term: losses.policy_loss per token, times the IS weights, aggregated once
    (agg_loss); the metrics the masked means of its parts."""
    per_token, parts = policy_loss(logp, old, adv, **clips)
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics = {key: masked_mean(part, mask).item() for key, part in parts.items()}
    return agg_loss(per_token, mask, agg_mode, num_tokens=num_tokens), metrics


def _pl(d, adv, **kw):
    """policy_loss for one token per row: logp - old_logp = d, advantage adv; returns loss, metrics, grad."""
    logp = T(d, dtype=torch.float64).reshape(-1, 1).requires_grad_()
    old = torch.zeros_like(logp)
    a = T(adv, dtype=torch.float64).reshape(-1, 1)
    loss, metrics = policy_term(logp, old, a, torch.ones_like(a), **kw)
    loss.backward()
    return loss.item(), metrics, logp.grad.flatten().tolist()


def test_on_policy_ratio_one():
    loss, m, grad = _pl([0.0, 0.0], [1.0, -0.5])
    assert loss == pytest.approx(-(1.0 - 0.5) / 2)
    assert m == {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}
    assert grad == pytest.approx([-1.0 / 2, 0.5 / 2])  # d/dlogp of -A*ratio / N


def test_clip_higher_is_asymmetric():
    d = math.log(1.25)  # ratio 1.25, A > 0
    loss, m, grad = _pl([d], [1.0], clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.25) and m["pg_clipfrac"] == 0.0 and grad[0] == pytest.approx(-1.25)
    loss, m, grad = _pl([d], [1.0], clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2) and m["pg_clipfrac"] == pytest.approx(1.0) and grad == [0.0]  # no gradient
    loss, m, grad = _pl([math.log(0.75)], [-1.0], clip_low=0.2, clip_high=0.28)  # ratio 0.75 < 0.8, A < 0
    assert loss == pytest.approx(0.8) and m["pg_clipfrac"] == pytest.approx(1.0) and grad == [0.0]


def test_dual_clip_bounds_negative_advantages():
    loss, m, grad = _pl([5.0], [-2.0])  # ratio e^5 = 148: unbounded -A*ratio would be 297
    assert loss == pytest.approx(2.0 * 3.0)  # -A * clip_c
    assert m["pg_clipfrac_lower"] == pytest.approx(1.0) and m["pg_clipfrac"] == 0.0 and grad == [0.0]
    loss, m, _ = _pl([5.0], [-2.0], clip_c=10.0)
    assert loss == pytest.approx(20.0)
    loss, m, grad = _pl([5.0], [2.0])  # A > 0: no dual clip, ordinary clip
    assert loss == pytest.approx(-2.0 * 1.2) and m["pg_clipfrac_lower"] == 0.0 and grad == [0.0]
    loss, m, grad = _pl([math.log(2.0)], [-1.0])  # 1.2 < ratio 2 < clip_c: unclipped, gradient flows
    assert loss == pytest.approx(2.0) and m["pg_clipfrac"] == 0.0 and grad[0] == pytest.approx(2.0)


def test_log_ratio_clamped_at_20_and_ppo_kl():
    # row 1: A < 0, ratio e^20 (clamped), dual clip disabled; row 2: A > 0, ratio e^-20, not clipped
    loss, m, _ = _pl([30.0, -30.0], [-1.0, 1.0], clip_c=1e12)
    assert loss == pytest.approx((math.exp(20) - math.exp(-20)) / 2, rel=1e-12)
    assert m["ppo_kl"] == pytest.approx(0.0)  # mean(-d) = (-20 + 20) / 2
    _, m, _ = _pl([0.1, 0.3], [1.0, 1.0])
    assert m["ppo_kl"] == pytest.approx(-0.2)


def test_masked_rows_do_not_contribute():
    logp = T([[0.1, 0.2], [9.0, -9.0]])
    old = torch.zeros(2, 2)
    adv = T([[1.0, 1.0], [-3.0, -3.0]])
    mask = T([[1.0, 1.0], [0.0, 0.0]])
    loss, m = policy_term(logp, old, adv, mask)
    loss_first, m_first = policy_term(logp[:1], old[:1], adv[:1], mask[:1])
    assert loss.item() == pytest.approx(loss_first.item()) and m == pytest.approx(m_first)
    loss_global, _ = policy_term(logp, old, adv, mask, num_tokens=4)
    assert loss_global.item() == pytest.approx(loss.item() / 2)


def test_policy_loss_and_agg_loss_bad_args():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_c must be > 1.0"):
        policy_loss(x, x, x, clip_c=1.0)
    with pytest.raises(ValueError, match="accepted: token-mean"):
        agg_loss(x, torch.ones(2, 3), "sum")


def test_policy_loss_shape_mismatch():
    with pytest.raises(ValueError, match="shapes must match"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2))


def _ref_weighted_pg(logp, old, adv, mask, w, mode, clip_low=0.2, clip_high=0.28, clip_c=3.0):
    """veRL compute_policy_loss_vanilla with rollout_is_weights, per token in float64 Python."""
    rows = []
    for lr, orow, ar, mr, wr in zip(*(t.tolist() for t in (logp, old, adv, mask, w)), strict=True):
        losses = []
        for lp, o, a, m, wt in zip(lr, orow, ar, mr, wr, strict=True):
            r = math.exp(min(max(lp - o, -20.0), 20.0))
            clipped = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            losses.append((min(-a * clip_c, clipped) if a < 0 else clipped) * wt if m else None)
        rows.append([x for x in losses if x is not None])
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    filled = [r for r in rows if r]
    return sum(sum(r) / (len(r) + 1e-8) for r in filled) / len(filled)  # seq-mean-token-mean


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_is_weights_multiply_the_clipped_per_token_loss(mode):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.4
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.4
    logp[0, 0] = old[0, 0] + 1.5  # clipped above, A > 0
    adv = torch.tensor([1.0, -2.0, 0.5, -0.3], dtype=torch.float64)[:, None].expand(4, 6)  # [B, R]
    logp[1, 1] = old[1, 1] + 3.0  # dual clip, A < 0
    mask = (torch.arange(6)[None] < torch.tensor([6, 3, 0, 2])[:, None]).double()  # an empty row
    w = torch.rand(4, 6, generator=g, dtype=torch.float64) * 2 * mask
    kw = dict(clip_low=0.2, clip_high=0.28, agg_mode=mode)
    loss, metrics = policy_term(logp, old, adv, mask, is_weights=w, **kw)
    assert loss.item() == pytest.approx(_ref_weighted_pg(logp, old, adv, mask, w, mode), rel=1e-12)
    plain, plain_metrics = policy_term(logp, old, adv, mask, **kw)
    assert metrics == plain_metrics  # the weights touch the loss only
    ones, _ = policy_term(logp, old, adv, mask, is_weights=torch.ones_like(w), **kw)
    assert torch.equal(ones, plain)  # and is_weights=None is the unweighted loss, bit for bit
    assert plain.item() == pytest.approx(_ref_weighted_pg(logp, old, adv, mask, torch.ones_like(w), mode), rel=1e-12)


# ---------------------------------------------------------------- KL and entropy
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", 1.0),
        ("k1", 1.0),
        ("abs", 1.0),
        ("mse", 0.5),
        ("k2", 0.5),
        ("low_var_kl", math.exp(-1) + 1 - 1),
        ("k3", math.exp(-1)),
    ],
)
def test_kl_values_at_log_ratio_one(kind, expected):
    logp, ref = T([[0.0]]), T([[-1.0]])  # logp - ref = 1
    assert kl_penalty(logp, ref, kind).item() == pytest.approx(expected, rel=1e-6)
    assert kl_penalty(ref, ref, kind).item() == 0.0
    assert kl_penalty(logp, ref, kind + "+").item() == pytest.approx(expected, rel=1e-6)  # same forward


def test_low_var_kl_clamps():
    # ref - logp = 30 -> clamped to 20 -> exp(20) - 21 -> clamped to 10
    assert kl_penalty(T([[-30.0]]), T([[0.0]]), "low_var_kl").item() == 10.0
    # ref - logp = -30 -> clamped to -20 -> exp(-20) + 19 -> clamped to 10
    assert kl_penalty(T([[0.0]]), T([[-30.0]]), "k3").item() == 10.0
    assert kl_penalty(T([[0.0]]), T([[-1.0]]), "abs").item() == kl_penalty(T([[-1.0]]), T([[0.0]]), "abs").item()


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"])
def test_straight_through_variants_carry_the_k2_gradient(kind):
    ref = T([[-1.0, -0.2, -3.0]], dtype=torch.float64)
    logp = T([[-0.5, -0.9, -1.0]], dtype=torch.float64, requires_grad=True)
    kl_penalty(logp, ref, kind + "+").sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx((logp - ref).detach().flatten().tolist())  # d/dx 0.5x^2
    plain = logp.detach().clone().requires_grad_()
    kl_penalty(plain, ref, kind).sum().backward()
    if kind not in ("mse", "k2"):  # the plain estimator has a different gradient
        assert not torch.allclose(plain.grad, logp.grad)
    if kind in ("low_var_kl", "k3"):  # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
        assert plain.grad.flatten().tolist() == pytest.approx((1 - torch.exp(ref - logp)).detach().flatten().tolist())


def test_kl_bad_input():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full")
    with pytest.raises(ValueError, match="shapes must match"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 1))


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(2, 3, 16)).flatten().tolist() == pytest.approx([math.log(16)] * 6)
    assert entropy_from_logits(T([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    z = torch.randn(4, 5, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    expected = torch.distributions.Categorical(logits=z).entropy()
    assert torch.allclose(entropy_from_logits(z), expected, atol=1e-10)
    assert entropy_from_logits(T([[1.0, 2.0]])).item() == pytest.approx(
        -sum(p * math.log(p) for p in torch.softmax(T([1.0, 2.0]), 0).tolist())
    )


# ---------------------------------------------------------------- DAPO dynamic sampling: nonzero_std_groups
def _np_keep(values, n):
    """veRL's rule with numpy itself: drop a group iff n > 1 and float(np.std(values)) == 0.0."""
    return [not (n > 1 and float(np.std(values[i : i + n])) == 0.0) for i in range(0, len(values), n)]


def test_nonzero_std_groups_numpy_edge_cases():
    assert nonzero_std_groups([0.1] * 3, 3) == [True]  # np.std = 1.4e-17: kept
    assert nonzero_std_groups([0.1] * 8, 8) == [False]  # np.std = 0.0: dropped
    assert nonzero_std_groups(T([1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 3) == [True, False]
    assert nonzero_std_groups([5.0, 5.0], 1) == [True, True]  # a group of one is never dropped
    assert nonzero_std_groups([], 4) == []
    for values in ([0.1] * 3, [0.1] * 8, [0.1] * 119, [-1.7699756849662132] * 150, [0.7] * 300):
        assert nonzero_std_groups(values, len(values)) == _np_keep(values, len(values)), len(values)


def test_nonzero_std_groups_matches_numpy_on_many_groups():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 301))
        kind = rng.integers(4)
        if kind == 0:  # repeated values from a small pool (float32 rewards included)
            values = rng.choice([0.1, 0.2, 1 / 3, float(np.float32(0.1)), 0.7], size=2 * n)
        elif kind == 1:  # all equal
            values = np.full(2 * n, rng.uniform(-5, 5))
        elif kind == 2:  # all equal but one ulp
            values = np.full(2 * n, rng.uniform(-5, 5))
            values[rng.integers(2 * n)] = np.nextafter(values[0], 10)
        else:
            values = rng.uniform(-1, 1, size=2 * n).astype(np.float32).astype(np.float64)
        values = values.tolist()
        assert nonzero_std_groups(values, n) == _np_keep(values, n), (n, kind)


def test_nonzero_std_groups_float32_tensor_is_widened_exactly():
    rewards = T([0.1] * 8 + [0.1] * 7 + [0.2], dtype=torch.float32)
    values = [float(v) for v in np.asarray(rewards.numpy(), dtype=np.float64)]
    assert nonzero_std_groups(rewards, 8) == _np_keep(values, 8) == [False, True]


def test_nonzero_std_groups_bad_n():
    for n in (0, -1, 4, 2.0, True):
        with pytest.raises(ValueError, match="nonzero_std_groups: n="):
            nonzero_std_groups([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], n)

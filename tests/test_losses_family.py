"""The GRPO family, grpo_family.py (GSPO, CISPO, SAPO, GMPO through policy_term, as the loss runs them; RLOO,
REINFORCE++ and its baseline variant; KL in the reward) against INDEPENDENT implementations of veRL 0.9.1's
formulas: plain Python floats (float64), a loop per row and token, gradients derived by hand (no autograd), on a
batch with padded rows, a fully masked row, a one-token row, token-varying advantages and log-ratios past every
clamp (veRL's 10 and 20)."""

import functools
import math

import pytest
import torch

import grpo_family
import losses
from grpo_family import (
    adaptive_kl_coef,
    kl_in_reward,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from losses import token_level_scores

# 5 responses x 6 tokens: lengths 6, 3, 0 (fully masked), 1, 4.  GARBAGE sits at every masked position of
# logp / old / advantages: a loss that reads padding changes its value or gradient.
LENGTHS = [6, 3, 0, 1, 4]
GARBAGE = 7.5
D = [  # logp - old per token
    [0.1, -0.05, 0.45, 0.0, -0.2, 0.15],  # small: inside or near every clip
    [1.2, -0.9, 0.4],  # clipped above and below
    [],
    [25.0],  # past every clamp: GSPO's 10 (S = 25), CISPO's / SAPO's 20
    [-25.0, 0.05, -0.3, 0.6],  # past -20 at the first token
]
A = [  # advantages per token: rows 0 and 4 vary along the response (REINFORCE++-style), row 1 is negative
    [1.0, 1.0, 0.5, 0.5, 1.5, 1.5],
    [-2.0, -2.0, -2.0],
    [],
    [-0.8],  # with S = 25 > 10 and A < 0, GSPO's unclipped branch: only the clamp at 10 stops the gradient
    [-0.5, 0.0, 0.7, -1.0],
]
OLD = [[-1.0 - 0.3 * t - 0.1 * i for t in range(6)] for i in range(5)]  # any old log-probs < 0
W = [[0.5 + 0.1 * ((i + t) % 7) for t in range(6)] for i in range(5)]  # rollout-correction IS weights


def padded(rows, fill=GARBAGE):
    return torch.tensor([r + [fill] * (6 - len(r)) for r in rows], dtype=torch.float64)


def batch():
    """(logp [5, 6] requiring grad, old, advantages, mask, is_weights): the rows above, float64."""
    old = torch.tensor(OLD, dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor(LENGTHS)[:, None]).double()
    logp = torch.where(mask.bool(), old + padded(D), GARBAGE).requires_grad_()
    return logp, old, padded(A), mask, torch.tensor(W, dtype=torch.float64) * mask


def tokens(i):
    """(d, A, old, w) of each real token of row i."""
    return [(D[i][t], A[i][t], OLD[i][t], W[i][t]) for t in range(LENGTHS[i])]


def aggregate(per_token, mode, num_seqs=None):
    """veRL's agg_loss over Python lists [row][token] of (value, gradient): returns (loss, grads [row][token])."""
    n_tok = sum(map(len, per_token))
    rows = [r for r in per_token if r]
    seqs = num_seqs if num_seqs is not None else len(rows)
    if mode == "token-mean":
        scale = [[1 / n_tok] * len(r) for r in per_token]
    elif mode == "token-sum":
        scale = [[1.0] * len(r) for r in per_token]
    else:  # seq-mean-token-mean
        scale = [[1 / (len(r) + 1e-8) / seqs] * len(r) for r in per_token]
    loss = sum(v * s for r, sr in zip(per_token, scale, strict=True) for (v, _), s in zip(r, sr, strict=True))
    grads = [[g * s for (_, g), s in zip(r, sr, strict=True)] for r, sr in zip(per_token, scale, strict=True)]
    return loss, grads


def masked_mean_py(values):
    flat = [v for r in values for v in r]
    return sum(flat) / (len(flat) + 1e-8)


def check(loss, metrics, logp, ref_loss, ref_grads, ref_metrics):
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    for i, n in enumerate(LENGTHS):
        assert logp.grad[i, :n].tolist() == pytest.approx(ref_grads[i], rel=1e-12, abs=1e-12), f"row {i}"
        assert logp.grad[i, n:].abs().sum().item() == 0.0, f"padding of row {i} has a gradient"
    assert metrics == pytest.approx(ref_metrics, rel=1e-12, abs=1e-12)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def term(mode, logp, old, adv, mask, is_weights=None, agg_mode="token-mean", num_tokens=None, num_seqs=None, **kw):
    """grpo_family.policy_term of loss mode `mode`, aggregated by losses.agg_loss with these counts (as grpo's loss
    hands it over); kw: clip_low, clip_high, tau_pos, tau_neg."""
    actor = {
        "policy_loss": {"loss_mode": mode},
        "clip_ratio_low": kw.get("clip_low", 0.2),
        "clip_ratio_high": kw.get("clip_high", 0.2),
        "tau_pos": kw.get("tau_pos", 1.0),
        "tau_neg": kw.get("tau_neg", 1.05),
    }
    mb = {"advantages": adv, "response_mask": mask}
    if is_weights is not None:
        mb["is_weights"] = is_weights
    aggregate = functools.partial(losses.agg_loss, mode=agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return grpo_family.policy_term(actor, logp, old, mb, aggregate)


# ---------------------------------------------------------------- GSPO
def ref_gspo(lo, hi, weighted):
    """Per token (value, d value / d logp): S_i = mean_t d_it; s_i = exp(min(S_i, 10)); max(-A s, -A clip(s));
    the gradient flows only through the unclipped branch, as s_i * d logp_it, and none past the 10."""
    per_token, clipped = [], []
    for i in range(5):
        toks = tokens(i)
        S = sum(d for d, *_ in toks) / max(len(toks), 1)
        s = math.exp(min(S, 10.0))
        row, crow = [], []
        for _, a, _, w in toks:
            l1, l2 = -a * s, -a * clip(s, 1 - lo, 1 + hi)
            w = w if weighted else 1.0
            grad = -a * s * w if l1 >= l2 and S < 10 else 0.0
            row.append((max(l1, l2) * w, grad))
            crow.append(1.0 if l2 > l1 else 0.0)
        per_token.append(row)
        clipped.append(crow)
    kl = [[-d for d, *_ in tokens(i)] for i in range(5)]
    return per_token, {"pg_clipfrac": masked_mean_py(clipped), "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean_py(kl)}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_equals_the_formula(mode, weighted):
    logp, old, adv, mask, w = batch()
    loss, metrics = term(
        "gspo", logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg_mode=mode, is_weights=w if weighted else None
    )
    per_token, ref_metrics = ref_gspo(0.2, 0.28, weighted)
    check(loss, metrics, logp, *aggregate(per_token, mode), ref_metrics)
    assert 0 < metrics["pg_clipfrac"] < 1  # both branches taken


def test_gspo_has_no_dual_clip_and_uses_the_global_counts():
    x = torch.zeros(1, 2, dtype=torch.float64)
    loss, _ = term("gspo", x + 5.0, x, torch.full_like(x, -2.0), torch.ones_like(x))  # A < 0, ratio e^5
    assert loss.item() == pytest.approx(2.0 * math.exp(5.0), rel=1e-12)  # vanilla stops at -A * clip_ratio_c = 6
    logp, old, adv, mask, _ = batch()
    _, m = term("gspo", logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)  # the paper's clips
    # whole sequences clip: row 0 (s = 1.05, A > 0) and row 4's A < 0 tokens (s = 0.002); not the A < 0 rows
    # with s > 1 (1, 3) nor row 4's A >= 0 tokens: 8 of 14 tokens
    assert m["pg_clipfrac"] == pytest.approx(8 / 14)
    full, _ = term("gspo", logp, old, adv, mask)
    half, _ = term("gspo", logp, old, adv, mask, num_tokens=2 * mask.sum())
    assert half.item() == pytest.approx(full.item() / 2, rel=1e-12)


# ---------------------------------------------------------------- CISPO
def ref_cispo(lo, hi, weighted):
    """Per token: d = clamp(d, +-20), c = clip(exp(d), 1 - lo, 1 + hi) (a constant), value -c A logp,
    gradient -c A on EVERY token."""
    per_token, clipped = [], []
    for i in range(5):
        row, crow = [], []
        for d, a, o, w in tokens(i):
            w = w if weighted else 1.0
            r = math.exp(clip(d, -20, 20))
            c = clip(r, 1 - lo, 1 + hi)
            row.append((-c * a * (o + d) * w, -c * a * w))
            crow.append(1.0 if r != c else 0.0)
        per_token.append(row)
        clipped.append(crow)
    kl = [[-clip(d, -20, 20) for d, *_ in tokens(i)] for i in range(5)]
    return per_token, {"pg_clipfrac": masked_mean_py(clipped), "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean_py(kl)}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("clips", [(0.2, 0.28), (10.0, 0.2)])  # (10, 0.2): veRL's example, no lower bound
@pytest.mark.parametrize("weighted", [False, True])
def test_cispo_equals_the_formula(mode, clips, weighted):
    logp, old, adv, mask, w = batch()
    weights = w if weighted else None
    loss, metrics = term(
        "cispo", logp, old, adv, mask, clip_low=clips[0], clip_high=clips[1], agg_mode=mode, is_weights=weights
    )
    per_token, ref_metrics = ref_cispo(*clips, weighted)
    check(loss, metrics, logp, *aggregate(per_token, mode), ref_metrics)
    assert all(g != 0 for i in (0, 1, 3) for g in logp.grad[i, : LENGTHS[i]].tolist())  # clipped tokens too


# ---------------------------------------------------------------- SAPO
def ref_sapo(tau_pos, tau_neg, weighted):
    """Per token: r = exp(clamp(d, +-20)); tau by the sign of A (A = 0: tau_neg); sigma = sigmoid(tau (r - 1));
    value -A sigma 4 / tau; gradient -A 4 sigma (1 - sigma) r (0 past the clamp)."""
    per_token = []
    for i in range(5):
        row = []
        for d, a, _, w in tokens(i):
            w = w if weighted else 1.0
            r = math.exp(clip(d, -20, 20))
            tau = tau_pos if a > 0 else tau_neg
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            grad = -a * 4 * sig * (1 - sig) * r * w if abs(d) < 20 else 0.0
            row.append((-a * sig * 4 / tau * w, grad))
        per_token.append(row)
    kl = [[-clip(d, -20, 20) for d, *_ in tokens(i)] for i in range(5)]
    return per_token, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean_py(kl)}


@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
@pytest.mark.parametrize("weighted", [False, True])
def test_sapo_equals_the_formula_always_seq_mean_token_mean(taus, weighted):
    logp, old, adv, mask, w = batch()
    loss, metrics = term(
        "sapo", logp, old, adv, mask, tau_pos=taus[0], tau_neg=taus[1], num_seqs=5, is_weights=w if weighted else None
    )
    per_token, ref_metrics = ref_sapo(*taus, weighted)
    check(loss, metrics, logp, *aggregate(per_token, "seq-mean-token-mean", num_seqs=5), ref_metrics)


def test_sapo_on_policy_gradient_is_the_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -0.5, 0.0]], dtype=torch.float64)
    loss, _ = term("sapo", logp, logp.detach(), adv, torch.ones_like(adv), agg_mode="token-sum")  # sapo's own
    loss.backward()
    n = 3 + 1e-8  # seq-mean-token-mean's token count
    assert logp.grad[0].tolist() == pytest.approx([-1.0 / n, 0.5 / n, 0.0], rel=1e-12)  # -A / L: f'(1) = 1
    assert loss.item() == pytest.approx((-2.0 / 1.0 + 0.5 * 2.0 / 1.05) / n, rel=1e-12)  # value -(2 / tau) A


# ---------------------------------------------------------------- GMPO (geo_mean)
def ref_geo_mean(lo, hi, weighted):
    """Per row: g_t = d_t capped at hi where A > 0, floored at -lo where A < 0, 0 where A = 0;
    rho = exp(sum g / (L + 1e-8)), Abar = sum A / (L + 1e-8); loss = mean over ALL rows of -Abar rho w_row,
    w_row = exp(sum log(w + 1e-10) / (L + 1e-8)); d loss / d logp_t = -Abar rho w_row / B / (L + 1e-8) where
    g_t follows d (not clipped), else 0."""
    losses, grads, upper, lower = [], [], [], []
    for i in range(5):
        toks, n = tokens(i), LENGTHS[i] + 1e-8
        g, free = [], []
        for d, a, _, _ in toks:
            if a > 0:
                g.append(min(d, hi))
                free.append(d <= hi)
            elif a < 0:
                g.append(max(d, -lo))
                free.append(d >= -lo)
            else:
                g.append(0.0)
                free.append(False)
        rho, abar = math.exp(sum(g) / n), sum(a for _, a, _, _ in toks) / n
        w_row = math.exp(sum(math.log(w + 1e-10) for *_, w in toks) / n) if weighted else 1.0
        losses.append(-abar * rho * w_row)
        grads.append([-abar * rho * w_row / 5 / n if f else 0.0 for f in free])
        upper.append([1.0 if not -lo <= d <= hi and a > 0 else 0.0 for d, a, _, _ in toks])
        lower.append([1.0 if not -lo <= d <= hi and a < 0 else 0.0 for d, a, _, _ in toks])
    kl = [[-d for d, *_ in tokens(i)] for i in range(5)]
    metrics = {
        "pg_clipfrac": masked_mean_py(upper),
        "pg_clipfrac_lower": masked_mean_py(lower),
        "ppo_kl": masked_mean_py(kl),
    }
    return sum(losses) / 5, grads, metrics


@pytest.mark.parametrize("weighted", [False, True])
def test_geo_mean_equals_the_formula(weighted):
    logp, old, adv, mask, w = batch()
    weights = w if weighted else None
    loss, metrics = term("geo_mean", logp, old, adv, mask, clip_low=0.4, clip_high=0.4, is_weights=weights)
    check(loss, metrics, logp, *ref_geo_mean(0.4, 0.4, weighted))
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_lower"] > 0


# ---------------------------------------------------------------- advantage estimators
REWARDS = [1.0, 0.0, 0.5, 3.0, 1.0, 0.0, 2.0, 1.0]
GROUPS = ["a", "b", "a", "c", "b", "a", "b", "b"]  # interleaved; "c" is a group of one


def test_rloo_equals_leave_one_out():
    """A_i = r_i - mean of the OTHER rewards of i's group; a group of one keeps A = r."""
    adv = rloo_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS)
    for i, (r, g) in enumerate(zip(REWARDS, GROUPS, strict=True)):
        others = [x for j, (x, h) in enumerate(zip(REWARDS, GROUPS, strict=True)) if h == g and j != i]
        expected = r - sum(others) / len(others) if others else r
        assert adv[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-15), i
    assert rloo_advantages([1, 0, 1], "qqq").tolist() == pytest.approx([0.5, -1.0, 0.5])
    assert rloo_advantages([1, 0, 1], "qqq").dtype == torch.float32


def whiten_py(rows):
    """veRL's masked_whiten over every real token of rows (lists of per-token values), its 1e-8s included."""
    flat = [v for r in rows for v in r]
    n = len(flat)
    mu = sum(flat) / (n + 1e-8)
    var = sum((v - mu) ** 2 for v in flat) / (n + 1e-8) * n / (n - 1)
    return [[(v - mu) / math.sqrt(var + 1e-8) for v in r] for r in rows]


# per-token rewards of 8 responses of lengths 3, 1, 0 (fully masked), 5, 2, 4, 5, 1; a rejected token (a hole)
# in rows 3 and 6; non-zero rewards along the responses (KL in the reward) plus each row's score at its end
LENS = [3, 1, 0, 5, 2, 4, 5, 1]
HOLES = {(3, 1), (6, 3)}


def token_batch():
    g = torch.Generator().manual_seed(3)
    sampled = (torch.arange(5)[None] < torch.tensor(LENS)[:, None]).double()  # [8, 5]
    mask = sampled.clone()
    for i, t in HOLES:
        mask[i, t] = 0.0
    rewards = (torch.randn(8, 5, generator=g, dtype=torch.float64) * 0.1) * sampled
    rewards += token_level_scores(torch.tensor(REWARDS, dtype=torch.float64), sampled)
    return rewards, mask


def test_reinforce_pp_baseline_equals_the_formula():
    rewards, mask = token_batch()
    adv = reinforce_pp_baseline_advantages(rewards, mask, GROUPS)
    sums = rewards.sum(-1).tolist()  # the whole row, holes included (veRL sums token_level_rewards)
    centred = []
    for i, g in enumerate(GROUPS):
        group = [s for s, h in zip(sums, GROUPS, strict=True) if h == g]
        centred.append(sums[i] - (sum(group) / len(group) if len(group) > 1 else 0.0))
    kept = [[t for t in range(5) if mask[i, t]] for i in range(8)]
    expected = whiten_py([[centred[i]] * len(kept[i]) for i in range(8)])
    for i in range(8):
        assert adv[i, kept[i]].tolist() == pytest.approx(expected[i], rel=1e-12), i
    assert (adv * (1 - mask)).abs().sum().item() == 0.0


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_equals_the_formula(gamma):
    """Returns G_t = r_t + gamma G_next over the kept tokens; a hole passes the return on (its own reward is
    dropped); whitened over every kept token of the batch."""
    rewards, mask = token_batch()
    adv, returns = reinforce_pp_advantages(rewards, mask, gamma)
    ref_returns, kept = [], []
    for i in range(8):
        row, running = [0.0] * 5, 0.0
        for t in reversed(range(5)):
            if mask[i, t]:
                running = rewards[i, t].item() + gamma * running
                row[t] = running
        ref_returns.append(row)
        kept.append([t for t in range(5) if mask[i, t]])
    assert returns.tolist() == [pytest.approx(r, rel=1e-12) for r in ref_returns]
    expected = whiten_py([[ref_returns[i][t] for t in kept[i]] for i in range(8)])
    for i in range(8):
        assert adv[i, kept[i]].tolist() == pytest.approx(expected[i], rel=1e-12), i
    assert (adv * (1 - mask)).abs().sum().item() == 0.0


def test_masked_whiten_hand_values_and_too_few_tokens():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    out = masked_whiten(x, m)
    assert out[m.bool()].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-7)  # mu 2, var 1 (up to the 1e-8s)
    with pytest.raises(ValueError, match="masked_whiten: 1 masked entries"):
        masked_whiten(x, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64))


# ---------------------------------------------------------------- KL in the reward
def test_token_level_scores_put_the_score_at_the_last_sampled_token():
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert token_level_scores(torch.tensor([2.0, 5.0]), mask).tolist() == [[2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "mse"])
def test_kl_in_reward_equals_the_formula(kind):
    g = torch.Generator().manual_seed(5)
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 1])[:, None]).double()
    old = torch.randn(3, 4, generator=g, dtype=torch.float64) - 2
    ref = old + torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.5
    scores = token_level_scores(torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64), mask)
    rewards, row_kl = kl_in_reward(scores, losses.kl_penalty(old, ref, kind) * mask, mask, beta=0.1)
    for i in range(3):
        kls = []
        for t in range(4):
            x = old[i, t].item() - ref[i, t].item()
            k = {"kl": x, "mse": 0.5 * x * x, "low_var_kl": clip(math.exp(-x) + x - 1, -10, 10)}[kind]
            k = k if mask[i, t] else 0.0
            kls.append(k)
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.1 * k, rel=1e-12, abs=1e-15)
        assert row_kl[i].item() == pytest.approx(sum(kls) / (mask[i].sum().item() + 1e-8), rel=1e-12)


def test_adaptive_kl_coef():
    assert adaptive_kl_coef(0.001, 0.3, 0.1, 10000, 512) == pytest.approx(0.001 * (1 + 0.2 * 512 / 10000))
    assert adaptive_kl_coef(0.001, 0.0, 0.1, 10000, 512) == pytest.approx(0.001 * (1 - 0.2 * 512 / 10000))
    assert adaptive_kl_coef(0.001, 0.11, 0.1, 1000, 100) == pytest.approx(0.001 * (1 + 0.1 * 0.1))

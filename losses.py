"""GRPO math, exactly as veRL 0.9 computes it. Torch only: copy this file anywhere.

  grpo_advantages             core_algos.compute_grpo_outcome_advantage
  policy_loss                 core_algos.compute_policy_loss_vanilla (clip-higher + dual clip, rollout IS weights)
  kl_penalty                  core_algos.kl_penalty (k1/abs/k2/k3 and the "+" straight-through forms)
  entropy_from_logits         verl.utils.torch_functional.entropy_from_logits
  agg_loss                    core_algos.agg_loss (token-mean & co., with GLOBAL counts)
  masked_mean                 verl.utils.torch_functional.masked_mean
  rollout_is_weights          rollout_corr_helper.compute_rollout_correction_weights (token/sequence, TIS/IcePop)
  rollout_rejection_mask      rollout_corr_helper.compute_rollout_rejection_mask (the 11 rollout_rs options)
  offpolicy_metrics           rollout_corr_helper.compute_offpolicy_metrics (ppl, kl, chi2 diagnostics)
  rollout_correction_metrics  rollout_corr_helper.compute_is_metrics + the rejection fractions (a subset)
  nonzero_std_groups          DAPO filter_groups: numpy's float64 std of each group of rewards != 0

Shapes: B responses, T response tokens (right-padded), V vocabulary. `mask` is the
response mask [B, T] (1 = a real response token). The total GRPO loss of veRL is

    loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss

with every term aggregated by `agg_loss` over the same tokens. Rollout correction (veRL
`algorithm.rollout_correction`, off by default; verl/trainer/ppo/rollout_corr_helper.py) multiplies the
per-token PG loss by `rollout_is_weights` and/or replaces `mask` by `rollout_rejection_mask`, both computed
once per step on the whole batch from the old and the rollout (vLLM) log-probs.

Worked example (one prompt, three responses, rewards [1, 0, 1]):
    >>> grpo_advantages(torch.tensor([1., 0., 1.]), ["q", "q", "q"])
    tensor([ 0.5774, -1.1547,  0.5774])
"""

import math
from collections import defaultdict
from functools import reduce
from operator import add

import torch

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean")  # veRL's actor.policy_loss.loss_mode: policy_loss, ...
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus")  # algorithm.adv_estimator
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # each also with a "+" suffix
SAFETY_BOUND = 20.0  # veRL clamps log-ratios to [-20, 20] before exp
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)  # veRL's rollout_rs options
IS_THRESHOLD_FORMS = (
    'a number > 0 (TIS cap, e.g. 2.0 or "2.0") or a string "lo_hi" with 0 < lo <= hi (IcePop, e.g. "0.5_5.0")'
)
RS_THRESHOLD_FORMS = (
    'one spec for all options or one per option (comma-separated); k1: "lo_hi" with 0 < lo <= hi '
    'or a number hi > 0 (lo = 1/hi); k2, k3: a number > 0 (no "_")'
)


def _check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{where}: shapes must match, got {shapes}")


def _nonzero(count: torch.Tensor | float) -> torch.Tensor | float:
    """count, or 1 where count == 0 (an empty batch then aggregates to 0, not NaN)."""
    return count + (count == 0) if torch.is_tensor(count) else (count or 1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / (sum(mask) + 1e-8)   (veRL masked_mean; masked NaN/inf are ignored).

    masked_mean([1, 2, 3], [1, 1, 0]) = 3 / 2 = 1.5
    """
    _check_same_shape("masked_mean", x=x, mask=mask)
    total = torch.where(mask.bool(), x, 0.0) * mask  # [B, T]
    if dim is None:
        return total.sum() / (mask.sum() + 1e-8)
    return total.sum(dim) / (mask.sum(dim) + 1e-8)


def agg_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] to a scalar (veRL `agg_loss`).

    token-mean:               sum(x * m) / N_tokens
    token-sum:                sum(x * m)   (no normaliser: the gradient grows with the token count; veRL 0.9)
    seq-mean-token-sum:       sum_i (sum_t x_it m_it) / N_seqs
    seq-mean-token-mean:      sum_i (sum_t x_it m_it / (sum_t m_it + 1e-8)) / N_seqs
    seq-mean-token-sum-norm:  seq-mean-token-sum / scale_factor (veRL's actor.loss_scale_factor; None: T, the
                              width of `mask`, as veRL's agg_loss). Pass the generation budget (max response
                              length, Dr. GRPO's constant): veRL's batches are padded to it, so its T is that
                              constant, while a micro-batch trimmed to its longest row would weigh each row
                              by its neighbours (the trainer passes it unless actor.loss_scale_factor is set)

    N_tokens defaults to sum(m) and N_seqs to the number of rows with at least one token (veRL's
    defaults). Pass `num_tokens` / `num_seqs` = the GLOBAL counts of the whole mini-batch (all
    micro-batches, all ranks) and sum the micro-batch losses: the gradient is then the exact global
    mean. veRL's quirk, followed by the trainer: its actor passes N_seqs = global_batch_size = ALL rows
    of the mini-batch (ppo_mini_batch_size * n), so a row with an empty response adds 0 to the sum but
    still counts in the mean. (veRL also multiplies by dp_size to undo FSDP's gradient averaging; the
    trainer does that.)
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg_loss: mode={mode!r}; accepted: {', '.join(AGG_MODES)}")
    _check_same_shape("agg_loss", values=values, mask=mask)
    if values.dim() != 2:
        raise ValueError(f"agg_loss: values must be [batch, tokens], got shape {tuple(values.shape)}")
    masked = torch.where(mask.bool(), values, 0.0) * mask  # [B, T]
    if mode == "token-mean":
        count = mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / _nonzero(count)
    if mode == "token-sum":
        return masked.sum()
    seq_tokens = mask.sum(-1)  # [B]
    seq_has_tokens = (seq_tokens > 0).to(values.dtype)  # [B]
    if mode == "seq-mean-token-mean":
        seq_losses = masked.sum(-1) / (seq_tokens + 1e-8)  # [B]
    else:
        seq_losses = masked.sum(-1)  # [B]
    count = seq_has_tokens.sum() if num_seqs is None else num_seqs
    loss = (seq_losses * seq_has_tokens).sum() / _nonzero(count)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (scale_factor if scale_factor is not None else mask.shape[-1])
    return loss


def _grouped(where: str, rewards, group_ids) -> tuple[torch.Tensor, list[list[int]]]:
    """(rewards as a float 1-D tensor, the row indices of each group in order of first appearance)."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()  # veRL's token_level_rewards are float32
    if rewards.dim() != 1:
        raise ValueError(f"{where}: rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    group_ids = list(group_ids)
    if len(group_ids) != len(rewards):
        raise ValueError(f"{where}: {len(rewards)} rewards but {len(group_ids)} group_ids")
    members = defaultdict(list)  # group id -> row indices, in order
    for i, gid in enumerate(group_ids):
        members[gid].append(i)
    return rewards, list(members.values())


def grpo_advantages(rewards, group_ids, eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """One advantage per response (veRL `compute_grpo_outcome_advantage`).

    A_i = (r_i - mean_g) / (std_g + eps), std UNBIASED (torch.std), g = the group of response i
    (the n responses of one prompt share a group id). norm_by_std=False: A_i = r_i - mean_g.
    A group of one has mean 0 and std 1 (A = r / (1 + eps)); identical rewards give 0.

    rewards [1, 0, 1] in one group -> [+0.5774, -1.1547, +0.5774].
    The trainer broadcasts A_i over response i's tokens (A[:, None] * mask).
    """
    rewards, members = _grouped("grpo_advantages", rewards, group_ids)
    advantages = rewards.detach().clone()  # [B]
    for rows in members:
        scores = rewards[rows]  # [n]
        if len(rows) == 1:
            mean, std = scores.new_tensor(0.0), scores.new_tensor(1.0)
        else:
            mean, std = scores.mean(), scores.std()
        centred = scores - mean
        advantages[rows] = centred / (std + eps) if norm_by_std else centred
    return advantages


def rloo_advantages(rewards, group_ids) -> torch.Tensor:
    """One advantage per response: its reward minus the mean of the OTHER responses of its prompt (veRL
    `compute_rloo_outcome_advantage`; RLOO, arXiv 2402.14740).

    A_i = r_i - sum_{j != i} r_j / (n - 1) = n / (n - 1) * (r_i - mean_g)   (group size n > 1; no std)
    A group of one keeps A = r_i (veRL's rule; its rloo_vectorized variant would give 0).

    rewards [1, 0, 1] in one group -> [0.5, -1.0, 0.5].  Computed as veRL does, in float32:
    r_i * n / (n - 1) - mean_g * n / (n - 1). The trainer broadcasts A_i over response i's tokens.
    """
    rewards, members = _grouped("rloo_advantages", rewards, group_ids)
    advantages = rewards.detach().clone()  # [B]
    for rows in members:
        n = len(rows)
        if n > 1:
            mean = rewards[rows].mean()
            advantages[rows] = rewards[rows] * n / (n - 1) - mean * n / (n - 1)
    return advantages


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mu) / sqrt(var + 1e-8) over the masked entries of the WHOLE tensor (veRL `masked_whiten`).

    mu = masked_mean(x);  var = masked_mean((x - mu)^2) * N / (N - 1), N = sum(mask) (unbiased; N <= 1 raises)
    Token-weighted: a long response counts once per token. Values at masked entries are whitened too
    (the callers multiply by the mask afterwards).
    x = [1, 2, 3], mask all 1: mu 2, var 1 -> [-1, 0, 1] (up to the 1e-8).
    """
    _check_same_shape("masked_whiten", values=values, mask=mask)
    count = mask.sum()
    if count <= 1:
        raise ValueError(f"masked_whiten: {int(count)} masked entries; at least 2 are needed for the variance")
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask) * (count / (count - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids) -> torch.Tensor:
    """REINFORCE++ with the group mean as baseline, whitened over the batch (veRL
    `compute_reinforce_plus_plus_baseline_outcome_advantage`; arXiv 2501.03262).

    r_i = sum_t token_rewards_it;  b_g = the mean of r over i's group (0 for a group of one)
    x_it = (r_i - b_g) * m_it;  A = masked_whiten(x, m) * m      token_rewards, mask, A: [B, T]
    Pass the WHOLE batch of all ranks: the whitening statistics are over all its tokens.
    Example: rewards [1, 0] (one group), lengths 1 and 3: x = [[0.5], [-0.5, -0.5, -0.5]]: mu -0.25,
    var 1/3 -> A = [[1.299], [-0.433] * 3].
    """
    _check_same_shape("reinforce_pp_baseline_advantages", token_rewards=token_rewards, mask=mask)
    scores, members = _grouped("reinforce_pp_baseline_advantages", token_rewards.sum(-1), group_ids)  # [B]
    centred = scores.detach().clone()  # [B]
    for rows in members:
        if len(rows) > 1:
            centred[rows] = scores[rows] - scores[rows].mean()
    x = centred[:, None].expand(mask.shape) * mask  # [B, T]
    return masked_whiten(x, mask) * mask


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the batch, no baseline (veRL
    `compute_reinforce_plus_plus_outcome_advantage`; arXiv 2501.03262). Returns (advantages, returns) [B, T].

    From the last token to the first: G_t = token_rewards_t + gamma * G_{t+1}; returns_t = G_t * m_t;
    a masked token passes its successor's return on unchanged (veRL: running = G_t m_t + running (1 - m_t)).
    A = masked_whiten(returns, m) * m; the returns stay unwhitened. gamma is veRL's algorithm.gamma.
    Meant for per-token rewards (KL in the reward): with a score only at the last token and gamma = 1 every
    token of a response has the same return. Pass the WHOLE batch of all ranks (the whitening).
    Example: token_rewards [[0, 0, 1]], gamma 0.5 -> returns [[0.25, 0.5, 1]].
    """
    _check_same_shape("reinforce_pp_advantages", token_rewards=token_rewards, mask=mask)
    returns = torch.zeros_like(token_rewards)  # [B, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + gamma * running  # [B]
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])  # [B]
    return masked_whiten(returns, mask) * mask, returns


def token_level_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The scores [B] as veRL's per-token rewards [B, T]: score i at response i's LAST token (index L_i - 1,
    L_i = sum_t mask_it over every sampled token), 0 elsewhere (veRL's rm_scores, agent_loop.py).
    scores [2, 5], lengths [1, 3], T = 3 -> [[2, 0, 0], [0, 0, 5]]."""
    out = torch.zeros(mask.shape, dtype=scores.dtype)  # [B, T]
    last = mask.sum(-1).long() - 1  # [B]
    out[torch.arange(len(scores)), last] = scores
    return out


def kl_in_reward(
    token_scores: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind="kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards with the KL to the reference subtracted (veRL ray_trainer.py `apply_kl_penalty`).

    kl_t = kl_penalty(old_logp, ref_logp, kind) * m_t     (the OLD policy's log-probs, not the update's)
    token_rewards = token_scores - beta * kl;   row_kl_i = masked_mean_t(kl_i)
    Returns (token_rewards [B, T], row_kl [B]); veRL logs actor/reward_kl_penalty = mean_i row_kl_i (over
    the whole batch) and actor/reward_kl_penalty_coeff = beta. An outcome estimator (grpo, rloo) then sees
    r_i = score_i - beta * sum_t kl_it; REINFORCE++ sees the per-token rewards.
    Example: score 1 at the last of 2 tokens, old - ref = [0.5, 0.1], kind "kl", beta 0.1 ->
    rewards [-0.05, 0.99], row_kl 0.3.
    """
    kl = kl_penalty(old_logp, ref_logp, kind) * mask  # [B, T]
    return token_scores - beta * kl, masked_mean(kl, mask, dim=-1)


def adaptive_kl_coef(beta: float, current_kl: float, target_kl: float, horizon: int, n_steps: int) -> float:
    """The next beta of veRL's AdaptiveKLController.update (Ziegler et al. 2019, arXiv 1909.08593):
    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  beta * (1 + e * n_steps / horizon)
    (veRL passes n_steps = the batch's row count). beta 0.001, kl 0.3, target 0.1, 512 rows, horizon 10000
    -> 0.001 * (1 + 0.2 * 0.0512) = 0.0010102."""
    error = min(max(current_kl / target_kl - 1, -0.2), 0.2)
    return beta * (1 + error * n_steps / horizon)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg_mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher and dual clip (veRL `compute_policy_loss_vanilla`).

    d = clamp(logp - old_logp, -20, 20);  ratio = exp(d)
    L1 = -A * ratio;  L2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high);  Lc = max(L1, L2)
    dual clip (A < 0 only): loss = min(-A * clip_c, Lc)
    metrics: pg_clipfrac = mean(L2 > L1), pg_clipfrac_lower = mean(Lc > -A*clip_c and A < 0),
             ppo_kl = mean(-d)   (masked means over response tokens)

    All tensors [B, T] (advantages already broadcast over tokens). Returns (loss, metrics);
    the loss is aggregated with `agg_loss(agg_mode, num_tokens, num_seqs, scale_factor)`.
    is_weights [B, T] (from `rollout_is_weights`, detached): the per-token loss (after both clips) is
    multiplied by them before aggregation, as veRL does with `rollout_is_weights`; metrics are unchanged.
    Example: A = 1, ratio = 1.5, clip_high = 0.2 -> L1 = -1.5, L2 = -1.2, loss = -1.2 (clipped, no gradient).
    """
    if not clip_c > 1.0:
        raise ValueError(f"policy_loss: clip_c must be > 1.0 (dual-clip lower bound), got {clip_c}")
    _check_same_shape("policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    neg_approx_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    ratio = torch.exp(neg_approx_kl)  # [B, T]
    loss1 = -advantages * ratio  # [B, T]
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)  # [B, T]
    clipped = torch.maximum(loss1, loss2)  # [B, T]
    loss3 = -advantages * clip_c  # [B, T]
    dual_clipped = torch.min(loss3, clipped)  # [B, T]
    per_token = torch.where(advantages < 0, dual_clipped, clipped)  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights  # [B, T]
    loss = agg_loss(per_token, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor)
    with torch.no_grad():
        dual_clip_active = torch.gt(clipped, loss3).float() * (advantages < 0).float()  # [B, T]
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(loss2, loss1).float(), mask).item(),
            "pg_clipfrac_lower": masked_mean(dual_clip_active, mask).item(),
            "ppo_kl": masked_mean(-neg_approx_kl, mask).item(),
        }
    return loss, metrics


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg_mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one clipped ratio per SEQUENCE, the geometric mean of its token ratios (veRL
    `compute_policy_loss_gspo`; arXiv 2507.18071).

    d = logp - old_logp (unclamped);  S_i = sum_t d_it m_it / max(L_i, 1)   (L_i = response i's token count)
    log s_it = min(logp_it - sg(logp_it) + sg(S_i), 10);  s_it = exp(log s_it)   (sg = detach)
        value exp(S_i) on every token of row i, gradient exp(S_i) * grad logp_it (none if S_i > 10)
    L1 = -A * s;  L2 = -A * clamp(s, 1 - clip_low, 1 + clip_high);  loss_t = max(L1, L2)   (NO dual clip)
    metrics: pg_clipfrac = mean(L2 > L1), pg_clipfrac_lower = 0, ppo_kl = mean(-d)   (masked means)

    Aggregated with agg_mode, as veRL 0.9.1 does (0.9.0 forced seq-mean-token-mean, the paper's objective:
    set actor.loss_agg_mode to it, as veRL's GSPO example does). is_weights multiply the per-token loss.
    Example: one row, d = [0.2, 0.0], A = 1, clips 3e-4 / 4e-4: S = 0.1, s = 1.105 > 1.0004 -> loss -1.0004,
    clipped on both tokens, no gradient.
    """
    _check_same_shape("gspo_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = logp - old_logp  # [B, T]
    lengths = mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = (log_ratio * mask).sum(-1) / lengths  # [B]: S_i, veRL's sum (not NaN-safe)
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach()[:, None], max=10.0)  # [B, T]
    s = torch.exp(log_s)  # [B, T]
    loss1 = -advantages * s  # [B, T]
    loss2 = -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high)  # [B, T]
    per_token = torch.maximum(loss1, loss2)  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights  # [B, T]
    loss = agg_loss(per_token, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(loss2, loss1).float(), mask).item(),
            "pg_clipfrac_lower": 0.0,
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg_mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: REINFORCE with the importance weight clipped and detached (veRL `compute_policy_loss_cispo`;
    arXiv 2506.13585, MiniMax-M1).

    d = clamp(logp - old_logp, -20, 20);  r = exp(d);  c = sg(clamp(r, 1 - clip_low, 1 + clip_high))
    loss_t = -c * A * logp_t      gradient -c * A * grad logp: EVERY token keeps one (PPO drops clipped ones)
    metrics: pg_clipfrac = mean(r != c) (either side), pg_clipfrac_lower = 0, ppo_kl = mean(-d)

    The value is -c * A * logp (logp < 0), not a PPO surrogate: actor/pg_loss is not comparable with the
    other modes'. No dual clip. Aggregated with agg_mode; is_weights multiply the per-token loss.
    clip_low >= 1 leaves no lower bound (veRL's example: clip_ratio_low 10, clip_ratio_high 0.2: r <= 1.2).
    Example: logp = -2, r = 3 (clipped to 1.2), A = 1 -> loss 2.4, gradient -1.2.
    """
    _check_same_shape("cispo_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = torch.clamp(logp - old_logp, min=-SAFETY_BOUND, max=SAFETY_BOUND)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)  # [B, T]
    per_token = -clipped.detach() * advantages * logp  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights  # [B, T]
    loss = agg_loss(per_token, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, scale_factor=scale_factor)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio != clipped).float(), mask).item(),
            "pg_clipfrac_lower": 0.0,
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    num_seqs: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip (veRL `compute_policy_loss_sapo`;
    arXiv 2511.20347, Qwen).

    r = exp(clamp(logp - old_logp, -20, 20));  tau = tau_pos where A > 0, else tau_neg (A = 0 too)
    f(r) = sigmoid(tau * (r - 1)) * 4 / tau;  loss_t = -f(r) * A
    f'(r) = 4 sigmoid (1 - sigmoid): 1 at r = 1 (on-policy the gradient is the plain PG gradient, the value
    -(2 / tau) * A), fading smoothly as r leaves 1, faster for larger tau.
    metrics: pg_clipfrac = pg_clipfrac_lower = 0, ppo_kl = mean(-d)

    veRL FORCES seq-mean-token-mean for this term (num_seqs: the global row count), whatever
    actor.loss_agg_mode says; the entropy and KL terms keep loss_agg_mode. tau_pos / tau_neg are veRL's
    actor.tau_pos / actor.tau_neg. is_weights multiply the per-token loss.
    Example: r = 1, A = 1, tau_pos = 1 -> f = 0.5 * 4 = 2, loss -2, gradient -A * f'(1) * r = -1.
    """
    _check_same_shape("sapo_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = torch.clamp(logp - old_logp, min=-SAFETY_BOUND, max=SAFETY_BOUND)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    taus = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype),
        torch.as_tensor(tau_neg, dtype=advantages.dtype),
    )  # [B, T]
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)  # [B, T]
    per_token = -gates * advantages  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights  # [B, T]
    loss = agg_loss(per_token, mask, "seq-mean-token-mean", num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean(-log_ratio, mask).item()}
    return loss, metrics


def geo_mean_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    num_seqs: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO: the geometric mean of the token ratios, clipped per token in LOG space (veRL
    `compute_policy_loss_geo_mean`; arXiv 2507.20673).

    d = logp - old_logp (unclamped);  dc = clamp(d, -clip_low, clip_high);  g = sgn(A) * min(sgn(A) d, sgn(A) dc)
        (A > 0: d capped at clip_high; A < 0: d floored at -clip_low; A = 0: g = 0)
    rho_i = exp(sum_t g_it m_it / (L_i + 1e-8));  Abar_i = sum_t A_it m_it / (L_i + 1e-8)
    loss = sum_i(-Abar_i * rho_i) / num_seqs;  num_seqs None: the rows of these tensors (veRL's torch.mean)
    is_weights: per row exp(sum_t log(w_it + 1e-10) m_it / (L_i + 1e-8)) (their geometric mean) multiply the row.
    metrics: clipped = (d != dc); pg_clipfrac = mean(clipped and A > 0), pg_clipfrac_lower = mean(clipped
    and A < 0), ppo_kl = mean(-d)   (masked means over tokens)

    actor.loss_agg_mode does not apply. veRL takes torch.mean over each micro-batch, so its gradient grows with
    the number of micro-batches per rank; pass num_seqs = the mini-batch's global row count (as the trainer
    does) for the mean over the whole mini-batch, whatever the split: the same value as veRL's when the
    mini-batch is one micro-batch.
    Example: one row, d = [0.6, 0.0], A = 1, clips 0.4: g = [0.4, 0], rho = exp(0.2), loss = -1.2214.
    """
    _check_same_shape("geo_mean_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = logp - old_logp  # [B, T]
    sign = torch.sign(advantages)  # [B, T]
    clamped = torch.clamp(log_ratio, -clip_low, clip_high)  # [B, T]
    g = sign * torch.min(sign * log_ratio, sign * clamped)  # [B, T]
    lengths = mask.sum(-1) + 1e-8  # [B]
    rho = torch.exp((g * mask).sum(-1) / lengths)  # [B]
    seq_advantage = (advantages * mask).sum(-1) / lengths  # [B]
    per_seq = -seq_advantage * rho  # [B]
    if is_weights is not None:
        per_seq = per_seq * torch.exp((torch.log(is_weights + 1e-10) * mask).sum(-1) / lengths)  # [B]
    loss = torch.mean(per_seq) if num_seqs is None else per_seq.sum() / _nonzero(num_seqs)
    with torch.no_grad():
        clipped = torch.ne(log_ratio, clamped)  # [B, T]
        metrics = {
            "pg_clipfrac": masked_mean((clipped * (advantages > 0)).float(), mask).item(),
            "pg_clipfrac_lower": masked_mean((clipped * (advantages < 0)).float(), mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


def _kl_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    # low_var_kl / k3 (Schulman): exp(ref - logp) - (ref - logp) - 1, clamped for stability
    log_ratio = torch.clamp(ref_logp - logp, min=-20, max=20)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (veRL `kl_penalty`).

    k1/"kl":  logp - ref                 "abs": |logp - ref|
    k2/"mse": 0.5 * (logp - ref)^2
    k3/"low_var_kl": k = clamp(ref - logp, -20, 20); clamp(exp(k) - k - 1, -10, 10)
    "<kind>+" (e.g. "k3+"): straight-through: the forward value of <kind>, the gradient of k2.

    logp = ref -> 0 for every kind;  logp - ref = 1 -> k1 1, k2 0.5, k3 e^-1 = 0.3679.
    """
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        accepted = ", ".join(KL_KINDS + tuple(k + "+" for k in KL_KINDS))
        raise ValueError(f"kl_penalty: kind={kind!r}; accepted: {accepted}")
    _check_same_shape("kl_penalty", logp=logp, ref_logp=ref_logp)
    forward = _kl_forward(logp, ref_logp, base)  # [B, T]
    if not kind.endswith("+") or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (logp - ref_logp).square()  # [B, T]
    return k2 - k2.detach() + forward.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim (veRL `entropy_from_logits`).

    H = logsumexp(z) - sum(softmax(z) * z); logits [..., V] -> [...], already divided by the
    sampling temperature. Uniform over V tokens -> log(V).
    """
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)  # [...]


# ---------------------------------------------------------------- rollout correction (veRL rollout_corr_helper.py)
def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(-1)  # [B]  veRL masked_sum(axis=-1)


def _bounds(spec, ranged: bool, lo_default: bool, error: str = "") -> tuple[float | None, float]:
    """(lo, hi) of one threshold spec: "lo_hi" (only if ranged) or a number hi, then lo = 1/hi if lo_default
    else None (veRL's parsers). ValueError(error) unless 0 < hi and 0 < lo <= hi.
    "0.5_5.0" -> (0.5, 5.0);  2 -> (0.5, 2.0) with lo_default, (None, 2.0) without.
    """
    text = str(spec).strip() if isinstance(spec, (int, float, str)) and not isinstance(spec, bool) else "?"
    lo, hi = text.split("_", 1) if "_" in text else (None, text)
    try:
        hi = float(hi)
        lo = float(lo) if lo is not None else (1.0 / hi if lo_default and hi > 0 else None)
    except ValueError:
        raise ValueError(error) from None
    if not (hi > 0 and (lo is None or ranged and 0 < lo <= hi)):
        raise ValueError(error)
    return lo, hi


def rollout_is_weights(old_logp, rollout_logp, mask, level="token", threshold=2.0, batch_normalize=False):
    """Truncated importance weights pi_old / pi_rollout, detached, 0 at padding (veRL
    trainer/ppo/rollout_corr_helper.py: compute_rollout_correction_weights).

    d = old_logp - rollout_logp.  token: w_t = exp(clamp(d_t, -20, 20)) * m_t.
    sequence: S_i = sum_t d_it m_it;  w_it = exp(clamp(S_i, -20, 20)) * m_it (the product of the token ratios).
    threshold: a number (or number string) cap -> TIS: w = min(w, cap);
               "lo_hi" -> IcePop: w kept where lo <= w <= hi, else 0 (a whole row at sequence level).
    batch_normalize (after truncation): w /= the batch mean: token level masked_mean(w, m) over all tokens,
    sequence level the mean, over rows with tokens, of each row's masked mean; skipped if that mean <= 1e-8.
    Pass the WHOLE global batch (veRL normalises over all ranks).

    Example: d = [ln 3, ln 0.5], threshold 2.0 -> token w = [2.0, 0.5];  "0.6_5" -> [3.0, 0.0];
             sequence, threshold 2.0 -> S = ln 1.5 -> w = [1.5, 1.5].
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is_weights: level={level!r}; accepted: token, sequence")
    error = f"rollout_is_weights: threshold={threshold!r}; accepted: {IS_THRESHOLD_FORMS}"
    lo, hi = _bounds(threshold, True, False, error)
    _check_same_shape("rollout_is_weights", old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    with torch.no_grad():
        delta = old_logp - rollout_logp  # [B, R]
        if level == "sequence":
            delta = _masked_sum(delta, mask)[:, None]  # [B, 1]
        w = torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand(mask.shape) * mask  # [B, R]
        w = w.clamp(max=hi) if lo is None else torch.where((w >= lo) & (w <= hi), w, 0.0)  # [B, R]
        if batch_normalize:
            rows = (mask.sum(-1) > 0).to(w.dtype)  # [B]
            mean = (
                masked_mean(w, mask)
                if level == "token"
                else (masked_mean(w, mask, -1) * rows).sum() / rows.sum().clamp_min(1e-8)
            )
            w = w / mean if mean > 1e-8 else w  # [B, R]
    return w


def rollout_rejection_mask(old_logp, rollout_logp, mask, modes="token_k1", thresholds=None):
    """The response mask with off-policy tokens / rows rejected (veRL trainer/ppo/rollout_corr_helper.py:
    compute_rollout_rejection_mask with _parse_rollout_rs_thresholds).

    x = clamp(old_logp - rollout_logp, -20, 20);  k1 = -x,  k2 = x^2 / 2,  k3 = exp(x) - 1 - x.
    Statistic: token_kN per token; seq_sum_kN / seq_mean_kN the row's masked sum / masked_mean (with its
    + 1e-8); seq_max_kN the max over the row's tokens (veRL: 0 for an empty row, which has no token anyway).
    Keep: k1: ln(lo) <= stat <= ln(hi);  k2, k3: stat <= hi.  modes: a comma list, all must pass
    (duplicates ignored); thresholds: RS_THRESHOLD_FORMS.  Returns mask * keep, in mask's dtype.

    Example: x = [0.1, -0.5], "token_k1", thresholds 1.5: k1 = [-0.1, 0.5], bounds ln(1/1.5) = -0.405,
             ln 1.5 = 0.405 -> [1, 0];  "token_k2,seq_max_k2" with "1,0.1": max k2 = 0.125 > 0.1 -> [0, 0].
    """
    options = list(dict.fromkeys(o.strip() for o in str(modes).split(",") if o.strip()))
    if not options or any(o not in RS_OPTIONS for o in options):
        raise ValueError(f"rollout_rejection_mask: modes={modes!r}; accepted: a comma list of {', '.join(RS_OPTIONS)}")
    error = f"rollout_rejection_mask: thresholds={thresholds!r} for modes {options}; accepted: {RS_THRESHOLD_FORMS}"
    specs = [p.strip() for p in str(thresholds).split(",") if p.strip()] if thresholds is not None else []
    if len(specs) not in (1, len(options)):
        raise ValueError(error)
    if len(specs) == 1:  # one threshold for every option
        specs = specs * len(options)
    bounds = [_bounds(spec, o[-1] == "1", o[-1] == "1", error) for o, spec in zip(options, specs, strict=True)]
    _check_same_shape("rollout_rejection_mask", old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    x = torch.clamp(old_logp - rollout_logp, -SAFETY_BOUND, SAFETY_BOUND)  # [B, R]
    keep = torch.ones_like(x)  # [B, R]
    for option, (lo, hi) in zip(options, bounds, strict=True):
        k = {"1": -x, "2": 0.5 * x**2, "3": torch.exp(x) - 1.0 - x}[option[-1]]  # [B, R]
        if option.startswith("seq_max"):  # an empty row's -inf (veRL: 0) is harmless: no token to reject
            k = k.masked_fill(~mask.bool(), -math.inf).amax(-1, keepdim=True)  # [B, 1]
        elif option.startswith("seq_"):
            k = (_masked_sum(k, mask) if "sum" in option else masked_mean(k, mask, -1))[:, None]  # [B, 1]
        ok = (k >= math.log(lo)) & (k <= math.log(hi)) if option[-1] == "1" else k <= hi  # [B, R] or [B, 1]
        keep = keep * ok.to(x.dtype)  # [B, R]
    return (mask * keep).to(mask.dtype)


def offpolicy_metrics(old_logp, rollout_logp, mask) -> dict[str, float]:
    """veRL's training/rollout mismatch diagnostics, unprefixed (veRL trainer/ppo/rollout_corr_helper.py:
    compute_offpolicy_metrics; veRL logs them as rollout_corr/<key>).

    Per row: o_i = masked_mean_t(old_i), r_i = masked_mean_t(rollout_i) (0 for an empty row), diff_i = r_i - o_i;
    mean_i runs over ALL rows, empty ones included (veRL's .mean()); d = old - rollout.
    training_ppl = mean_i exp(-o_i), training_log_ppl = mean_i(-o_i), rollout_ppl / rollout_log_ppl likewise;
    kl = masked_mean(-d); k3_kl = masked_mean(exp(d) - d - 1) (d unclamped); log_ppl_diff / _abs_diff / _max /
    _min = mean / mean |.| / max / min of diff_i; ppl_ratio = mean_i exp(diff_i);
    chi2_token = masked_mean(exp(clamp(d, +-20))^2) - 1;  chi2_seq = mean_i exp(2 clamp(sum_t d_it m_it, +-20)) - 1.

    Example: old = rollout everywhere -> kl = k3_kl = chi2_token = chi2_seq = 0, ppl_ratio = 1.
    """
    with torch.no_grad():
        old_mean, roll_mean = masked_mean(old_logp, mask, -1), masked_mean(rollout_logp, mask, -1)  # [B]
        delta = old_logp - rollout_logp  # [B, R]
        diff = roll_mean - old_mean  # [B]
        seq = _masked_sum(delta, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B]
        m = {
            "training_ppl": torch.exp(-old_mean).mean(),
            "training_log_ppl": (-old_mean).mean(),
            "kl": masked_mean(rollout_logp - old_logp, mask),
            "k3_kl": masked_mean(torch.exp(delta) - delta - 1, mask),
            "rollout_ppl": torch.exp(-roll_mean).mean(),
            "rollout_log_ppl": (-roll_mean).mean(),
            "log_ppl_diff": diff.mean(),
            "log_ppl_abs_diff": diff.abs().mean(),
            "log_ppl_diff_max": diff.max(),
            "log_ppl_diff_min": diff.min(),
            "ppl_ratio": torch.exp(diff).mean(),
            "chi2_token": masked_mean(torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0,
            "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0,
        }
    return {key: value.item() for key, value in m.items()}


def rollout_correction_metrics(old_logp, rollout_logp, mask, level=None, threshold=2.0, new_mask=None):
    """veRL's headline IS and RS metrics, unprefixed (veRL trainer/ppo/rollout_corr_helper.py: compute_is_metrics
    and the end of compute_rollout_rejection_mask). The rollout_is_* keys need level (and threshold, as given to
    rollout_is_weights); the rollout_rs_* keys need new_mask (rollout_rejection_mask's output). Left out: the
    per-option rollout_rs_<option>_* keys, rollout_is_std, rollout_is_seq_*, _oob_ratio, _batch_norm_factor.

    w = the truncated weights BEFORE batch normalisation (veRL's metrics are taken before it), raw = w before
    TIS / IcePop, lo = the IcePop lo or 1/cap.  rollout_is_mean = masked_mean(w).  token: max / min over the
    tokens of w, ratio_fraction_high / _low = masked_mean(raw > hi) / masked_mean(raw < lo).  sequence: with S_i
    the UNCLAMPED log-ratio sums of ALL rows, max = exp(min(max_i S_i, 20)), min = exp(min_i S_i),
    fraction_high / _low = mean_i(S_i > ln hi) / mean_i(S_i < ln lo) (ln taken in float32, as veRL does).
    eff_sample_size = 1 / masked_mean((w / (masked_mean(w) + 1e-8))^2) (veRL clamps w to [0, hi] first: a no-op).
    rollout_rs_masked_fraction = masked_mean(1 - new_mask) over the ORIGINAL mask;
    rollout_rs_seq_masked_fraction = the fraction of ALL rows with at least one rejected token.

    Example: token level, cap 2, d = [ln 3, 0] -> w = [2, 1]: mean 1.5, max 2, min 1, fraction_high 0.5, ESS 0.9.
    """
    out = {}
    with torch.no_grad():
        if level is not None:
            w = rollout_is_weights(old_logp, rollout_logp, mask, level, threshold)  # [B, R]
            lo, hi = _bounds(threshold, True, True)
            if level == "sequence":
                s = _masked_sum(old_logp - rollout_logp, mask)  # [B], unclamped
                top = torch.exp(s.max().clamp(max=SAFETY_BOUND))
                bottom = torch.exp(s.min())
                log_hi, log_lo = torch.log(torch.tensor(hi)), torch.log(torch.tensor(lo))  # float32, as veRL
                high = (s > log_hi).float().mean()
                low = (s < log_lo).float().mean()
            else:
                raw = torch.exp((old_logp - rollout_logp).clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask  # [B, R]
                top = w.masked_fill(~mask.bool(), -math.inf).max()
                bottom = w.masked_fill(~mask.bool(), math.inf).min()
                high = masked_mean((raw > hi).float(), mask)
                low = masked_mean((raw < lo).float(), mask)
            ess = masked_mean((w / (masked_mean(w, mask) + 1e-8)).square(), mask).item()
            ess = 1.0 / ess if ess else math.inf  # veRL raises ZeroDivisionError when every weight is 0
            out.update(
                rollout_is_mean=masked_mean(w, mask),
                rollout_is_max=top,
                rollout_is_min=bottom,
                rollout_is_ratio_fraction_high=high,
                rollout_is_ratio_fraction_low=low,
                rollout_is_eff_sample_size=ess,
            )
        if new_mask is not None:
            kept = new_mask.to(old_logp.dtype)  # [B, R]
            out["rollout_rs_masked_fraction"] = masked_mean(1.0 - kept, mask)
            out["rollout_rs_seq_masked_fraction"] = ((kept <= 0.5) & mask.bool()).any(-1).float().mean()
    return {key: float(value) for key, value in out.items()}


def _np_pairwise_sum(xs: list[float]) -> float:
    """numpy's float64 add.reduce, bit for bit (numpy/_core/src/umath/loops_utils.h.src: pairwise_sum):
    < 8 values left to right; <= 128: 8 strided accumulators, combined ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)),
    then the remainder left to right; more: split at n/2 rounded down to a multiple of 8.
    (Not Python's sum(): since 3.12 it compensates.)  [0.1] * 3 -> 0.30000000000000004.
    """
    n = len(xs)
    if n > 128:
        half = n // 2 - (n // 2) % 8
        return _np_pairwise_sum(xs[:half]) + _np_pairwise_sum(xs[half:])
    tail = n - n % 8  # 0 when n < 8: all accumulators stay -0.0, the rest is summed left to right
    r = [reduce(add, xs[j:tail:8], -0.0) for j in range(8)]  # accumulator j: x_j + x_{j+8} + ...
    return reduce(add, xs[tail:], ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])))


def _np_std(xs: list[float]) -> float:
    """np.std(xs) (float64, ddof=0): sqrt(pairwise_sum((x - mean)^2) / n) with mean = pairwise_sum(x) / n."""
    mean = _np_pairwise_sum(xs) / len(xs)
    return math.sqrt(_np_pairwise_sum([(x - mean) * (x - mean) for x in xs]) / len(xs))


def nonzero_std_groups(rewards, n: int) -> list[bool]:
    """DAPO dynamic sampling: does each group of n consecutive rewards carry a learning signal? (veRL
    trainer/ppo/v1/replay_buffer.py: _dapo_filtered_keys drops a group iff n > 1 and float(np.std(values)) == 0.0)

    rewards (1-D tensor or list) are converted to float64 exactly (float32 included), then numpy's std is
    reproduced in pure Python (_np_std). Evidence for not using torch: over 30000 random groups of sizes
    1..1100 (repeated, near-equal and random values) _np_pairwise_sum / _np_std matched np.add.reduce / np.std
    bit for bit, while torch.float64 std(correction=0) disagreed with np.std on "== 0" in 1326 of 20000 groups
    (e.g. 119 x 0.1: numpy 1.4e-17, torch 0.0; 150 x -1.7699...: numpy 0.0, torch 6.7e-16).

    [1, 0, 1, 1, 1, 1], n=3 -> [True, False];  [0.1] * 3 -> [True] (1.4e-17);  [0.1] * 8 -> [False] (0.0).
    """
    values = [float(v) for v in (rewards.double().tolist() if torch.is_tensor(rewards) else rewards)]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or len(values) % n:
        raise ValueError(f"nonzero_std_groups: n={n!r}; accepted: an int >= 1 dividing len(rewards) = {len(values)}")
    return [n == 1 or _np_std(values[i : i + n]) != 0.0 for i in range(0, len(values), n)]

"""The GRPO family beside GRPO, exactly as veRL 0.9.1 computes it: the policy losses GSPO, CISPO, SAPO and GMPO
(actor.policy_loss.loss_mode), the advantage estimators RLOO, REINFORCE++ and REINFORCE++ with a baseline
(algorithm.adv_estimator), and the KL penalty in the reward (algorithm.use_kl_in_reward, fixed or adaptive).
Torch and losses.py only, the component it extends: copy both files.

Entry points, each a part grpo.choose_parts chooses when its key is set:
  check_settings       the combinations veRL runs silently degenerate, refused (FamilyError, one line)
  loss_part            policy_term: the policy-gradient term of a family loss mode, aggregated
  advantages_part      compute_advantages: the estimator's advantages and returns, after the KL in the reward

  gspo_loss                         core_algos.compute_policy_loss_gspo     (arXiv 2507.18071)
  cispo_loss                        core_algos.compute_policy_loss_cispo    (arXiv 2506.13585)
  sapo_loss                         core_algos.compute_policy_loss_sapo     (arXiv 2511.20347)
  geo_mean_loss                     core_algos.compute_policy_loss_geo_mean (arXiv 2507.20673)
  rloo_advantages                   core_algos.compute_rloo_outcome_advantage
  reinforce_pp_baseline_advantages  core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
  reinforce_pp_advantages           core_algos.compute_reinforce_plus_plus_outcome_advantage
  kl_in_reward, adaptive_kl_coef    ray_trainer.apply_kl_penalty, core_algos.AdaptiveKLController

Shapes as in losses.py: B responses, T response tokens, `mask` the response mask [B, T].
"""

import functools

import torch

import losses

LOSS_MODES = ("gspo", "cispo", "sapo", "geo_mean")  # actor.policy_loss.loss_mode, beside vanilla (losses.py)
ESTIMATORS = ("rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus")  # algorithm.adv_estimator, beside grpo
SAFETY_BOUND = 20.0  # veRL clamps log-ratios to [-20, 20] before exp


class FamilyError(ValueError):
    """A loss mode or estimator combination refused; the message is one line."""


def check_settings(cfg: dict) -> None:
    """The loss mode and estimator combinations refused (veRL runs them, silently degenerate): rloo /
    reinforce_plus_plus_baseline with rollout.n = 1: no other sample to form the baseline (veRL then keeps A = r:
    plain REINFORCE); geo_mean with advantages that vary along the response (reinforce_plus_plus with the KL in the
    reward or gamma < 1): GMPO averages them per response, veRL supports only one per response."""
    al, n = cfg["algorithm"], cfg["rollout"]["n"]
    if al["adv_estimator"] in ("rloo", "reinforce_plus_plus_baseline") and n == 1:
        raise FamilyError(
            f"config: algorithm.adv_estimator = {al['adv_estimator']} needs rollout.n > 1 (its baseline comes from "
            "the other samples of the same prompt); with rollout.n = 1 use reinforce_plus_plus"
        )
    per_token = al["adv_estimator"] == "reinforce_plus_plus" and (al["use_kl_in_reward"] or al["gamma"] != 1)
    if cfg["actor"]["policy_loss"]["loss_mode"] == "geo_mean" and per_token:
        raise FamilyError(
            "config: actor.policy_loss.loss_mode = geo_mean takes one advantage per response, but "
            "algorithm.adv_estimator = reinforce_plus_plus with algorithm.use_kl_in_reward=true or algorithm.gamma "
            "< 1 gives each token its own; use another estimator or loss mode"
        )


def loss_part(cfg: dict):
    """The loop's policy term for actor.policy_loss.loss_mode (grpo.choose_parts), its settings checked first:
    policy_term(actor, logp, old_logp, mb, aggregate) -> (loss, metrics)."""
    check_settings(cfg)
    return policy_term


def advantages_part(cfg: dict, gather):
    """The loop's advantages for algorithm.adv_estimator and the KL in the reward (grpo.choose_parts), its settings
    checked first: advantages(run, batch) -> metrics, compute_advantages with gather (cluster.global_rows) and the
    KL-in-the-reward beta, algorithm.kl_ctrl.kl_coef, moved by its adaptive controller (as veRL's, it restarts with
    the process: a resumed run starts from the key's value)."""
    check_settings(cfg)
    return functools.partial(
        compute_advantages, gather=gather, beta={"kl_coef": cfg["algorithm"]["kl_ctrl"]["kl_coef"]}
    )


# ------------------------------------------------------------------------------------- policy losses
def policy_term(actor: dict, logp, old_logp, mb: dict, aggregate) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient term of actor.policy_loss.loss_mode (gspo, cispo, sapo, geo_mean), as grpo.policy_term
    computes vanilla's: the mode's per-token loss, times the rollout correction's IS weights when mb has them,
    aggregated with `aggregate(values, mask, mode=...)` (losses.agg_loss with the mini-batch's global counts and
    actor.loss_agg_mode); returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}: masked means).
    gspo and cispo aggregate with actor.loss_agg_mode, sapo always with seq-mean-token-mean (veRL forces it), and
    geo_mean sums its one value per row over the mini-batch's rows (seq-mean-token-sum of a [B, 1] column), its
    IS weights the row's geometric mean. mb: advantages, response_mask [b, R] (and is_weights)."""
    mode, advantages, mask = actor["policy_loss"]["loss_mode"], mb["advantages"], mb["response_mask"]
    weights, clips = mb.get("is_weights"), (actor["clip_ratio_low"], actor["clip_ratio_high"])
    if mode == "geo_mean":
        per_row, parts = geo_mean_loss(logp, old_logp, advantages, mask, *clips, is_weights=weights)  # [b]
        column = per_row[:, None]  # [b, 1]
        loss = aggregate(column, torch.ones_like(column), mode="seq-mean-token-sum")
    else:
        if mode == "gspo":
            per_token, parts = gspo_loss(logp, old_logp, advantages, mask, *clips)
        elif mode == "cispo":
            per_token, parts = cispo_loss(logp, old_logp, advantages, *clips)
        else:
            per_token, parts = sapo_loss(logp, old_logp, advantages, actor["tau_pos"], actor["tau_neg"])
        if weights is not None:
            per_token = per_token * weights  # [b, R]
        loss = aggregate(per_token, mask, mode="seq-mean-token-mean") if mode == "sapo" else aggregate(per_token, mask)
    return loss, {key: losses.masked_mean(part, mask).item() for key, part in parts.items()}


def gspo_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2, clip_high: float = 0.2) -> tuple:
    """GSPO: one clipped ratio per SEQUENCE, the geometric mean of its token ratios (veRL
    `compute_policy_loss_gspo`; arXiv 2507.18071). Returns (loss [B, T], metric parts [B, T]).

    d = logp - old_logp (unclamped);  S_i = sum_t d_it m_it / max(L_i, 1)   (L_i = response i's token count)
    log s_it = min(logp_it - sg(logp_it) + sg(S_i), 10);  s_it = exp(log s_it)   (sg = detach)
        value exp(S_i) on every token of row i, gradient exp(S_i) * grad logp_it (none if S_i > 10)
    L1 = -A * s;  L2 = -A * clamp(s, 1 - clip_low, 1 + clip_high);  loss_t = max(L1, L2)   (NO dual clip)
    parts: pg_clipfrac (L2 > L1), pg_clipfrac_lower (0), ppo_kl (-d)

    veRL 0.9.1 aggregates it with actor.loss_agg_mode (0.9.0 forced seq-mean-token-mean, the paper's objective:
    set actor.loss_agg_mode to it, as veRL's GSPO example does).
    Example: one row, d = [0.2, 0.0], A = 1, clips 3e-4 / 4e-4: S = 0.1, s = 1.105 > 1.0004 -> loss -1.0004,
    clipped on both tokens, no gradient.
    """
    losses.check_same_shape("gspo_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = logp - old_logp  # [B, T]
    lengths = mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = (log_ratio * mask).sum(-1) / lengths  # [B]: S_i, veRL's sum (not NaN-safe)
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach()[:, None], max=10.0)  # [B, T]
    s = torch.exp(log_s)  # [B, T]
    loss1 = -advantages * s  # [B, T]
    loss2 = -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high)  # [B, T]
    with torch.no_grad():
        parts = {
            "pg_clipfrac": torch.gt(loss2, loss1).float(),
            "pg_clipfrac_lower": torch.zeros_like(loss1),
            "ppo_kl": -log_ratio,
        }
    return torch.maximum(loss1, loss2), parts


def cispo_loss(logp, old_logp, advantages, clip_low: float = 0.2, clip_high: float = 0.2) -> tuple:
    """CISPO: REINFORCE with the importance weight clipped and detached (veRL `compute_policy_loss_cispo`;
    arXiv 2506.13585, MiniMax-M1). Returns (loss [B, T], metric parts [B, T]).

    d = clamp(logp - old_logp, -20, 20);  r = exp(d);  c = sg(clamp(r, 1 - clip_low, 1 + clip_high))
    loss_t = -c * A * logp_t      gradient -c * A * grad logp: EVERY token keeps one (PPO drops clipped ones)
    parts: pg_clipfrac (r != c, either side), pg_clipfrac_lower (0), ppo_kl (-d)

    The value is -c * A * logp (logp < 0), not a PPO surrogate: actor/pg_loss is not comparable with the
    other modes'. No dual clip. clip_low >= 1 leaves no lower bound (veRL's example: clip_ratio_low 10,
    clip_ratio_high 0.2: r <= 1.2).
    Example: logp = -2, r = 3 (clipped to 1.2), A = 1 -> loss 2.4, gradient -1.2.
    """
    losses.check_same_shape("cispo_loss", logp=logp, old_logp=old_logp, advantages=advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-SAFETY_BOUND, max=SAFETY_BOUND)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)  # [B, T]
    with torch.no_grad():
        parts = {
            "pg_clipfrac": (ratio != clipped).float(),
            "pg_clipfrac_lower": torch.zeros_like(ratio),
            "ppo_kl": -log_ratio,
        }
    return -clipped.detach() * advantages * logp, parts


def sapo_loss(logp, old_logp, advantages, tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip (veRL `compute_policy_loss_sapo`;
    arXiv 2511.20347, Qwen). Returns (loss [B, T], metric parts [B, T]).

    r = exp(clamp(logp - old_logp, -20, 20));  tau = tau_pos where A > 0, else tau_neg (A = 0 too)
    f(r) = sigmoid(tau * (r - 1)) * 4 / tau;  loss_t = -f(r) * A
    f'(r) = 4 sigmoid (1 - sigmoid): 1 at r = 1 (on-policy the gradient is the plain PG gradient, the value
    -(2 / tau) * A), fading smoothly as r leaves 1, faster for larger tau.
    parts: pg_clipfrac and pg_clipfrac_lower (0), ppo_kl (-d)

    veRL FORCES seq-mean-token-mean for this term, whatever actor.loss_agg_mode says (policy_term); the entropy
    and KL terms keep loss_agg_mode. tau_pos / tau_neg are veRL's actor.tau_pos / actor.tau_neg.
    Example: r = 1, A = 1, tau_pos = 1 -> f = 0.5 * 4 = 2, loss -2, gradient -A * f'(1) * r = -1.
    """
    losses.check_same_shape("sapo_loss", logp=logp, old_logp=old_logp, advantages=advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-SAFETY_BOUND, max=SAFETY_BOUND)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    taus = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype),
        torch.as_tensor(tau_neg, dtype=advantages.dtype),
    )  # [B, T]
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)  # [B, T]
    zeros = torch.zeros_like(ratio)
    parts = {"pg_clipfrac": zeros, "pg_clipfrac_lower": zeros, "ppo_kl": -log_ratio.detach()}
    return -gates * advantages, parts


def geo_mean_loss(
    logp, old_logp, advantages, mask, clip_low: float = 0.4, clip_high: float = 0.4, is_weights=None
) -> tuple:
    """GMPO: the geometric mean of the token ratios, clipped per token in LOG space (veRL
    `compute_policy_loss_geo_mean`; arXiv 2507.20673). Returns (one loss per row [B], metric parts [B, T]).

    d = logp - old_logp (unclamped);  dc = clamp(d, -clip_low, clip_high);  g = sgn(A) * min(sgn(A) d, sgn(A) dc)
        (A > 0: d capped at clip_high; A < 0: d floored at -clip_low; A = 0: g = 0)
    rho_i = exp(sum_t g_it m_it / (L_i + 1e-8));  Abar_i = sum_t A_it m_it / (L_i + 1e-8);  loss_i = -Abar_i * rho_i
    is_weights: per row exp(sum_t log(w_it + 1e-10) m_it / (L_i + 1e-8)) (their geometric mean) multiply the row.
    parts: clipped = (d != dc); pg_clipfrac (clipped and A > 0), pg_clipfrac_lower (clipped and A < 0), ppo_kl (-d)

    actor.loss_agg_mode does not apply: the loss is the mean of loss_i over rows. veRL takes torch.mean over each
    micro-batch, so its gradient grows with the number of micro-batches per rank; policy_term takes the mean over
    the mini-batch's rows (all ranks), whatever the split: the same value as veRL's when a rank's mini-batch is one
    micro-batch.
    Example: one row, d = [0.6, 0.0], A = 1, clips 0.4: g = [0.4, 0], rho = exp(0.2), loss = -1.2214.
    """
    losses.check_same_shape("geo_mean_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    log_ratio = logp - old_logp  # [B, T]
    sign = torch.sign(advantages)  # [B, T]
    clamped = torch.clamp(log_ratio, -clip_low, clip_high)  # [B, T]
    g = sign * torch.min(sign * log_ratio, sign * clamped)  # [B, T]
    lengths = mask.sum(-1) + 1e-8  # [B]
    rho = torch.exp((g * mask).sum(-1) / lengths)  # [B]
    seq_advantage = (advantages * mask).sum(-1) / lengths  # [B]
    per_row = -seq_advantage * rho  # [B]
    if is_weights is not None:
        per_row = per_row * torch.exp((torch.log(is_weights + 1e-10) * mask).sum(-1) / lengths)  # [B]
    with torch.no_grad():
        clipped = torch.ne(log_ratio, clamped)  # [B, T]
        parts = {
            "pg_clipfrac": (clipped * (advantages > 0)).float(),
            "pg_clipfrac_lower": (clipped * (advantages < 0)).float(),
            "ppo_kl": -log_ratio,
        }
    return per_row, parts


# ------------------------------------------------------------------------ advantages and the KL in the reward
def compute_advantages(run, batch: dict, gather, beta: dict) -> dict:
    """veRL's apply_kl_penalty and compute_advantage on the WHOLE batch of all ranks (so nothing depends on the
    world size): the per-token rewards (each score at its response's last token; with algorithm.use_kl_in_reward,
    minus beta["kl_coef"] times the old policy's KL to the reference on every sampled token, before rejection), then
    algorithm.adv_estimator's advantages and returns over the response mask (after rejection). run: cfg,
    positions (this rank's prompts); beta["kl_coef"] is moved by algorithm.kl_ctrl's adaptive controller, after the
    penalty. gather(tensors, positions, groups) -> (the whole batch's tensors, this rank's rows in them)
    (cluster.global_rows). Fills
    batch["token_level_rewards"], ["advantages"], ["returns"] [B, R]; returns the KL metrics."""
    algorithm, n, kl_coef = run.cfg["algorithm"], run.cfg["rollout"]["n"], beta["kl_coef"]
    width = batch["response_mask"].shape[1]
    sampled = batch["attention_mask"][:, -width:].float()  # [B, R]: every sampled token, before rejection
    local = [losses.token_level_scores(batch["rewards"], sampled), sampled, batch["response_mask"]]
    if algorithm["use_kl_in_reward"]:
        local += [batch["old_logprobs"], batch["ref_logprobs"]]
    everything, mine = gather(local, run.positions, batch["uid"].tolist())
    rewards, out = everything[0], {}  # [B_all, R]
    if algorithm["use_kl_in_reward"]:
        scores, g_sampled, _, old, ref = everything
        kl = losses.kl_penalty(old, ref, algorithm["kl_penalty"]) * g_sampled  # [B_all, R]
        rewards, row_kl = kl_in_reward(scores, kl, g_sampled, kl_coef)
        out = {"actor/reward_kl_penalty": row_kl.mean().item(), "actor/reward_kl_penalty_coeff": kl_coef}
        controller = algorithm["kl_ctrl"]
        if controller["type"] == "adaptive":  # veRL's AdaptiveKLController.update, n_steps = the batch's rows
            current = out["actor/reward_kl_penalty"]
            beta["kl_coef"] = adaptive_kl_coef(
                kl_coef, current, controller["target_kl"], controller["horizon"], len(row_kl)
            )
    advantages, returns = estimate_advantages(algorithm, rewards, everything[2], n)
    for key, value in (("token_level_rewards", rewards), ("advantages", advantages), ("returns", returns)):
        batch[key] = value[mine, :width]  # [B, R]: this rank's rows
    return out


def estimate_advantages(algorithm: dict, token_rewards, mask, n: int) -> tuple:
    """(advantages, returns) [B, R] of algorithm.adv_estimator (veRL's compute_advantage): the ONE place that
    chooses. token_rewards, mask [B, R]: the whole batch, row k answering prompt k // n. grpo and rloo see each
    response's summed reward, broadcast back over its tokens; the REINFORCE++ pair whiten over all tokens."""
    groups = [k // n for k in range(len(token_rewards))]
    estimator = algorithm["adv_estimator"]
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(token_rewards, mask, algorithm["gamma"])
    if estimator == "reinforce_plus_plus_baseline":
        advantages = reinforce_pp_baseline_advantages(token_rewards, mask, groups)
        return advantages, advantages
    if estimator == "rloo":
        per_response = rloo_advantages(token_rewards.sum(-1), groups)  # [B]
    else:
        per_response = losses.grpo_advantages(
            token_rewards.sum(-1), groups, norm_by_std=algorithm["norm_adv_by_std_in_grpo"]
        )  # [B]
    advantages = per_response[:, None] * mask  # [B, R]
    return advantages, advantages


def kl_in_reward(token_scores, kl, mask, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards with the KL to the reference subtracted (veRL ray_trainer.py `apply_kl_penalty`).

    kl [B, T]: kl_penalty(old_logp, ref_logp, algorithm.kl_penalty) * m  (the OLD policy's log-probs, not the
    update's);  token_rewards = token_scores - beta * kl;   row_kl_i = masked_mean_t(kl_i)
    Returns (token_rewards [B, T], row_kl [B]); veRL logs actor/reward_kl_penalty = mean_i row_kl_i (over
    the whole batch) and actor/reward_kl_penalty_coeff = beta. An outcome estimator (grpo, rloo) then sees
    r_i = score_i - beta * sum_t kl_it; REINFORCE++ sees the per-token rewards.
    Example: score 1 at the last of 2 tokens, kl (kind "kl": old - ref) = [0.5, 0.1], beta 0.1 ->
    rewards [-0.05, 0.99], row_kl 0.3.
    """
    return token_scores - beta * kl, losses.masked_mean(kl, mask, dim=-1)


def rloo_advantages(rewards, group_ids) -> torch.Tensor:
    """One advantage per response: its reward minus the mean of the OTHER responses of its prompt (veRL
    `compute_rloo_outcome_advantage`; RLOO, arXiv 2402.14740).

    A_i = r_i - sum_{j != i} r_j / (n - 1) = n / (n - 1) * (r_i - mean_g)   (group size n > 1; no std)
    A group of one keeps A = r_i (veRL's rule; its rloo_vectorized variant would give 0).

    rewards [1, 0, 1] in one group -> [0.5, -1.0, 0.5].  Computed as veRL does, in float32:
    r_i * n / (n - 1) - mean_g * n / (n - 1). The trainer broadcasts A_i over response i's tokens.
    """
    rewards, members = losses.grouped("rloo_advantages", rewards, group_ids)
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
    losses.check_same_shape("masked_whiten", values=values, mask=mask)
    count = mask.sum()
    if count <= 1:
        raise ValueError(f"masked_whiten: {int(count)} masked entries; at least 2 are needed for the variance")
    mean = losses.masked_mean(values, mask)
    variance = losses.masked_mean((values - mean) ** 2, mask) * (count / (count - 1))
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
    losses.check_same_shape("reinforce_pp_baseline_advantages", token_rewards=token_rewards, mask=mask)
    scores, members = losses.grouped("reinforce_pp_baseline_advantages", token_rewards.sum(-1), group_ids)  # [B]
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
    losses.check_same_shape("reinforce_pp_advantages", token_rewards=token_rewards, mask=mask)
    returns = torch.zeros_like(token_rewards)  # [B, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + gamma * running  # [B]
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])  # [B]
    return masked_whiten(returns, mask) * mask, returns


def adaptive_kl_coef(beta: float, current_kl: float, target_kl: float, horizon: int, n_steps: int) -> float:
    """The next beta of veRL's AdaptiveKLController.update (Ziegler et al. 2019, arXiv 1909.08593):
    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  beta * (1 + e * n_steps / horizon)
    (veRL passes n_steps = the batch's row count). beta 0.001, kl 0.3, target 0.1, 512 rows, horizon 10000
    -> 0.001 * (1 + 0.2 * 0.0512) = 0.0010102."""
    error = min(max(current_kl / target_kl - 1, -0.2), 0.2)
    return beta * (1 + error * n_steps / horizon)

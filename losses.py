"""GRPO math, exactly as veRL 0.9 computes it: the functions a default run calls. Torch only: copy this file anywhere.

  grpo_advantages     one advantage per response, its reward normalised in its group (compute_grpo_outcome_advantage)
  policy_loss         PPO's clipped surrogate per token, clip-higher and dual clip (compute_policy_loss_vanilla)
  kl_penalty          the per-token KL to the reference: k1/abs/k2/k3 and the "+" straight-through forms (kl_penalty)
  entropy_from_logits the entropy of the sampling distribution per token (verl.utils.torch_functional)
  agg_loss            a per-token loss [B, T] to one number, token-mean & co. with GLOBAL counts (agg_loss)
  masked_mean         the mean over the response tokens (verl.utils.torch_functional.masked_mean)
  offpolicy_metrics   how far the trainer's log-probs are from vLLM's (rollout_corr_helper.compute_offpolicy_metrics)

(veRL names in parentheses: verl/trainer/ppo/core_algos.py unless said.) Shapes: B responses, T response tokens
(right-padded), V vocabulary. `mask` is the response mask [B, T] (1 = a real response token). Every loss here is
a PER-TOKEN tensor; the caller aggregates each term once, with the same mask and counts (CS336's and veRL's
split), so that veRL's total actor loss reads

    loss = agg(pg) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl),   agg = agg_loss(., mask, mode, counts)

Worked example (one prompt, three responses, rewards [1, 0, 1]):
    >>> grpo_advantages(torch.tensor([1., 0., 1.]), ["q", "q", "q"])
    tensor([ 0.5774, -1.1547,  0.5774])
The GRPO family's other losses and estimators, the rollout correction and DAPO's filter are files of their own
(grpo_family.py, rollout_correction.py, dapo.py), in the same style.
"""

from collections import defaultdict

import torch

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # each also with a "+" suffix
KL_ACCEPTED = ", ".join(KL_KINDS + tuple(k + "+" for k in KL_KINDS))
SAFETY_BOUND = 20.0  # veRL clamps log-ratios to [-20, 20] before exp


def check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    """ValueError naming `where` and every shape unless the tensors' shapes are all the same."""
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
    check_same_shape("masked_mean", x=x, mask=mask)
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
    check_same_shape("agg_loss", values=values, mask=mask)
    if values.dim() != 2:
        raise ValueError(f"agg_loss: values must be [batch, tokens], got shape {tuple(values.shape)}")
    masked = torch.where(mask.bool(), values, 0.0) * mask  # [B, T]
    if mode == "token-mean":
        count = mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / _nonzero(count)
    return _sum_or_seq_mean(masked, mask, mode, num_seqs, scale_factor)


def _sum_or_seq_mean(masked, mask, mode: str, num_seqs, scale_factor) -> torch.Tensor:
    """agg_loss of the modes beside token-mean, masked = the values with padding zeroed [B, T]."""
    if mode == "token-sum":
        return masked.sum()
    seq_tokens = mask.sum(-1)  # [B]
    seq_has_tokens = (seq_tokens > 0).to(masked.dtype)  # [B]
    if mode == "seq-mean-token-mean":
        seq_losses = masked.sum(-1) / (seq_tokens + 1e-8)  # [B]
    else:
        seq_losses = masked.sum(-1)  # [B]
    count = seq_has_tokens.sum() if num_seqs is None else num_seqs
    loss = (seq_losses * seq_has_tokens).sum() / _nonzero(count)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (scale_factor if scale_factor is not None else mask.shape[-1])
    return loss


def grouped(where: str, rewards, group_ids) -> tuple[torch.Tensor, list[list[int]]]:
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
    rewards, members = grouped("grpo_advantages", rewards, group_ids)
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


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token, with clip-higher and the dual clip (veRL `compute_policy_loss_vanilla`).

    d = clamp(logp - old_logp, -20, 20);  ratio = exp(d)
    L1 = -A * ratio;  L2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high);  Lc = max(L1, L2)
    dual clip (A < 0 only): loss = min(-A * clip_c, Lc)

    All tensors [B, T] (advantages already broadcast over tokens). Returns (loss [B, T], parts), parts the
    per-token indicators of veRL's metrics, each [B, T]: pg_clipfrac (L2 > L1), pg_clipfrac_lower (the dual clip
    binds: Lc > -A * clip_c and A < 0), ppo_kl (-d). The caller aggregates: agg_loss(loss, mask, ...) and
    masked_mean(part, mask) (importance weights, where a run has them, multiply the loss before aggregating).
    Example: A = 1, ratio = 1.5, clip_high = 0.2 -> L1 = -1.5, L2 = -1.2, loss = -1.2 (clipped, no gradient).
    """
    if not clip_c > 1.0:
        raise ValueError(f"policy_loss: clip_c must be > 1.0 (dual-clip lower bound), got {clip_c}")
    check_same_shape("policy_loss", logp=logp, old_logp=old_logp, advantages=advantages)
    neg_approx_kl = torch.clamp(logp - old_logp, min=-SAFETY_BOUND, max=SAFETY_BOUND)  # [B, T]
    ratio = torch.exp(neg_approx_kl)  # [B, T]
    loss1 = -advantages * ratio  # [B, T]
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)  # [B, T]
    clipped = torch.maximum(loss1, loss2)  # [B, T]
    loss3 = -advantages * clip_c  # [B, T]
    dual_clipped = torch.min(loss3, clipped)  # [B, T]
    loss = torch.where(advantages < 0, dual_clipped, clipped)  # [B, T]
    with torch.no_grad():
        parts = {
            "pg_clipfrac": torch.gt(loss2, loss1).float(),  # [B, T]
            "pg_clipfrac_lower": torch.gt(clipped, loss3).float() * (advantages < 0).float(),  # [B, T]
            "ppo_kl": -neg_approx_kl,  # [B, T]
        }
    return loss, parts


def _kl_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("low_var_kl", "k3"):  # Schulman's k3: exp(ref - logp) - (ref - logp) - 1, clamped for stability
        log_ratio = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    return _k1_abs_k2(logp, ref_logp, kind)


def _k1_abs_k2(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """kl_penalty's kinds beside k3: k1 (logp - ref), abs, k2 (0.5 (logp - ref)^2)."""
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    return 0.5 * (logp - ref_logp).square()


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
        raise ValueError(f"kl_penalty: kind={kind!r}; accepted: {KL_ACCEPTED}")
    check_same_shape("kl_penalty", logp=logp, ref_logp=ref_logp)
    forward = _kl_forward(logp, ref_logp, base)  # [B, T]
    if not kind.endswith("+") or base in ("mse", "k2"):
        return forward
    return _straight_through(logp, ref_logp, forward)


def _straight_through(logp: torch.Tensor, ref_logp: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
    """The value of `forward`, the gradient of k2 = 0.5 (logp - ref)^2: kl_penalty's "<kind>+"."""
    k2 = 0.5 * (logp - ref_logp).square()  # [B, T]
    return k2 - k2.detach() + forward.detach()


def token_level_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The scores [B] as veRL's per-token rewards [B, T]: score i at response i's LAST token (index L_i - 1,
    L_i = sum_t mask_it over every sampled token), 0 elsewhere (veRL's rm_scores, agent_loop.py).
    scores [2, 5], lengths [1, 3], T = 3 -> [[2, 0, 0], [0, 0, 5]]."""
    out = torch.zeros(mask.shape, dtype=scores.dtype)  # [B, T]
    last = mask.sum(-1).long() - 1  # [B]
    out[torch.arange(len(scores)), last] = scores
    return out


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim (veRL `entropy_from_logits`).

    H = logsumexp(z) - sum(softmax(z) * z); logits [..., V] -> [...], already divided by the
    sampling temperature. Uniform over V tokens -> log(V).
    """
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)  # [...]


def offpolicy_metrics(old_logp, rollout_logp, mask) -> dict[str, float]:
    """How far the trainer's log-probs (old) are from vLLM's (rollout) on the same tokens: perplexities, KL
    estimates and chi2, over the batch; logged as rollout_corr/<key> every step (veRL
    trainer/ppo/rollout_corr_helper.py: compute_offpolicy_metrics, its keys unprefixed).

    Per row: o_i = masked_mean_t(old_i), r_i = masked_mean_t(rollout_i) (0 for an empty row), diff_i = r_i - o_i;
    mean_i runs over ALL rows, empty ones included (veRL's .mean()); d = old - rollout.
    training_ppl = mean_i exp(-o_i), training_log_ppl = mean_i(-o_i), rollout_ppl / rollout_log_ppl likewise;
    kl = masked_mean(-d); k3_kl = masked_mean(exp(d) - d - 1) (d unclamped); log_ppl_diff / _abs_diff / _max /
    _min = mean / mean |.| / max / min of diff_i; ppl_ratio = mean_i exp(diff_i);
    chi2_token = masked_mean(exp(clamp(d, +-20))^2) - 1;  chi2_seq = mean_i exp(2 clamp(sum_t d_it m_it, +-20)) - 1.
    All tensors [B, R]; mask: every sampled token.

    Example: old = rollout everywhere -> kl = k3_kl = chi2_token = chi2_seq = 0, ppl_ratio = 1.
    """
    bound = SAFETY_BOUND
    with torch.no_grad():
        old_mean = masked_mean(old_logp, mask, -1)  # [B]
        roll_mean = masked_mean(rollout_logp, mask, -1)  # [B]
        delta = old_logp - rollout_logp  # [B, R]
        diff = roll_mean - old_mean  # [B]
        seq = (torch.where(mask.bool(), delta, 0.0) * mask).sum(-1).clamp(-bound, bound)  # [B]
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
            "chi2_token": masked_mean(torch.exp(delta.clamp(-bound, bound)).square(), mask) - 1.0,
            "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0,
        }
    return {key: value.item() for key, value in m.items()}

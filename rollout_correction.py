"""Rollout correction: the trainer's policy is not exactly the one vLLM sampled from (other kernels, bf16, an
off-policy replay), so the policy loss is reweighted by truncated importance weights pi_old / pi_vLLM and/or
off-policy tokens and rows are rejected from it (veRL's algorithm.rollout_correction, off by default;
verl/trainer/ppo/rollout_corr_helper.py). Torch and losses.py only, the component it extends: copy both files.

Entry points, each a part grpo.choose_parts chooses when its key is set:
  check_settings    the rollout_is / rollout_rs specs parsed, bypass_mode's combinations (CorrectionError)
  corrector         the loop's correct: over the WHOLE batch, once per step, veRL's diagnostics, then the IS weights,
                    the rejection mask and their metrics (correct)
  bypass_parts      bypass_mode: vLLM's log-probs stand as the old ones (rollout_as_old); with rollout_rs the policy
                    term rejecting against the CURRENT policy (bypass_rejection)

  rollout_is_weights          compute_rollout_correction_weights (token/sequence, TIS/IcePop)
  rollout_rejection_mask      compute_rollout_rejection_mask (the 11 rollout_rs options)
  rollout_correction_metrics  compute_is_metrics + the rejection fractions (a subset)
The off-policy diagnostics every run logs (rollout_corr/kl, _ppl, chi2, ...) are losses.offpolicy_metrics.
Shapes: B responses, R response tokens; `mask` every sampled token [B, R].
"""

import functools
import math

import torch

import losses

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


class CorrectionError(ValueError):
    """algorithm.rollout_correction settings this file cannot use; the message is one line."""


def check_settings(settings: dict) -> None:
    """algorithm.rollout_correction's keys, before anything loads (CorrectionError, one line): the rollout_is and
    rollout_rs specs parse (by the functions that use them), and bypass_mode takes no IS weights."""
    if settings["bypass_mode"] and settings["rollout_is"]:
        raise CorrectionError(
            f"config: algorithm.rollout_correction.rollout_is = {settings['rollout_is']!r} with bypass_mode=true; "
            "accepted: null (the PPO ratio is then pi / pi_rollout: veRL's bypass applies no weights)"
        )
    one = torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)
    try:
        if settings["rollout_is"]:
            rollout_is_weights(*one, level=settings["rollout_is"], threshold=settings["rollout_is_threshold"])
        if settings["rollout_rs"]:
            rollout_rejection_mask(*one, modes=settings["rollout_rs"], thresholds=settings["rollout_rs_threshold"])
    except ValueError as e:
        specs = ", ".join(f"{k} = {settings[k]!r}" for k in settings if k.startswith("rollout_"))
        raise CorrectionError(f"config: algorithm.rollout_correction.{specs}: {e}") from None


def enabled(settings: dict) -> bool:
    """Is the correction on (algorithm.rollout_correction.rollout_is or rollout_rs set)?"""
    return bool(settings["rollout_is"] or settings["rollout_rs"])


def corrector(settings: dict, replay_batches) -> object:
    """The loop's correct part (grpo.choose_parts), its settings checked first: correct(batch, old_logp, rollout_logp,
    sampled, response_mask, mine, apply) -> veRL's diagnostics (losses.offpolicy_metrics) and correct's metrics
    with these settings; a replay of dumps (replay_batches) keeps their weights and mask."""
    check_settings(settings)
    return functools.partial(diagnose_and_correct, settings=settings, dumped=bool(replay_batches))


def diagnose_and_correct(batch: dict, old_logp, rollout_logp, sampled, response_mask, mine, settings: dict, **kw):
    """grpo.diagnose_rollout's metrics (veRL's training/rollout mismatch diagnostics), then the correction (correct)."""
    diagnostics = losses.offpolicy_metrics(old_logp, rollout_logp, sampled)
    return {**diagnostics, **correct(batch, old_logp, rollout_logp, sampled, response_mask, mine, settings, **kw)}


def bypass_parts(parts, settings: dict):
    """bypass_mode's parts (grpo.choose_parts), its settings checked first: the old log-probs are vLLM's
    (rollout_as_old, before the reference's pass, as the step's old-log-prob phase puts them), the update's own
    forward diagnoses the mismatch (parts.given_old), and with rollout_rs the policy term rejects tokens against the
    current policy (bypass_rejection)."""
    check_settings(settings)
    parts.reference, parts.given_old = rollout_as_old(parts.reference), True
    if settings["rollout_rs"]:
        parts.policy_term = bypass_rejection(parts.policy_term, settings)
    return parts


def rollout_as_old(reference):
    """The reference's part with bypass_mode's old log-probs put in the batch first: vLLM's, batch["rollout_logprobs"]
    [B, R] (a replayed batch keeps its dumped ones)."""

    def vllm_old_then_reference(run, batch: dict, t: dict) -> None:
        batch.setdefault("old_logprobs", batch["rollout_logprobs"])
        reference(run, batch, t)

    return vllm_old_then_reference


def correct(
    batch: dict, old_logp, rollout_logp, sampled, response_mask, mine, settings: dict, apply=True, dumped=False
) -> dict:
    """veRL's compute_rollout_correction_and_add_to_batch, computed on the WHOLE batch of all ranks (old_logp,
    rollout_logp, sampled, response_mask [B_all, R]) and handed back to this rank's batch (its rows `mine`):
    with rollout_is, batch["is_weights"], the truncated IS weights (rollout_is_weights, batch-normalised over the
    whole batch if asked), which multiply the per-token policy loss; with rollout_rs, batch["response_mask"]
    with the rejected tokens and rows removed (it REPLACES the batch's: rejected tokens leave every loss term and
    its token counts). Returns the metrics (unprefixed). settings: algorithm.rollout_correction. Statistics are
    over every sampled token (`sampled`, before rejection), as veRL's. apply=False (bypass mode) or dumped (a replay
    of dumped batches, which keep their weights and mask): no new weights or mask, the metrics of the weights and of
    response_mask as it is."""
    width, apply = batch["response_mask"].shape[1], apply and not dumped
    weights = new_mask = None
    if apply and settings["rollout_is"]:
        weights = rollout_is_weights(
            old_logp,
            rollout_logp,
            sampled,
            level=settings["rollout_is"],
            threshold=settings["rollout_is_threshold"],
            batch_normalize=settings["rollout_is_batch_normalize"],
        )  # [B_all, R]
        batch["is_weights"] = weights[mine, :width]  # [B, R]: this rank's rows
    if apply and settings["rollout_rs"]:
        new_mask = rollout_rejection_mask(
            old_logp, rollout_logp, sampled, modes=settings["rollout_rs"], thresholds=settings["rollout_rs_threshold"]
        )  # [B_all, R]
        batch["response_mask"] = new_mask[mine, :width]
    return rollout_correction_metrics(
        old_logp,
        rollout_logp,
        sampled,
        level=settings["rollout_is"],
        threshold=settings["rollout_is_threshold"],
        new_mask=(response_mask if new_mask is None else new_mask) if settings["rollout_rs"] else None,
    )


def bypass_rejection(policy_term, settings: dict):
    """bypass_mode with rollout_rs (veRL's compute_policy_loss_bypass_mode): vLLM's log-probs stand as the old
    ones, and the rejection is taken against the CURRENT policy's log-probs inside the loss, for the policy term
    only (its metrics too); the entropy and KL terms keep the whole response mask. Wraps
    policy_term(actor, logp, old_logp, mb, aggregate) -> (loss, metrics), mb carrying rollout_logprobs [b, R]."""

    def rejecting_policy_term(actor, logp, old_logp, mb, aggregate):
        kept = rollout_rejection_mask(
            logp.detach(),
            mb["rollout_logprobs"],
            mb["response_mask"],
            settings["rollout_rs"],
            settings["rollout_rs_threshold"],
        )  # [b, R]
        return policy_term(actor, logp, old_logp, {**mb, "response_mask": kept}, aggregate)

    return rejecting_policy_term


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
    losses.check_same_shape("rollout_is_weights", old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    with torch.no_grad():
        delta = old_logp - rollout_logp  # [B, R]
        if level == "sequence":
            delta = _masked_sum(delta, mask)[:, None]  # [B, 1]
        w = torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand(mask.shape) * mask  # [B, R]
        w = w.clamp(max=hi) if lo is None else torch.where((w >= lo) & (w <= hi), w, 0.0)  # [B, R]
        if batch_normalize:
            rows = (mask.sum(-1) > 0).to(w.dtype)  # [B]
            mean = (
                losses.masked_mean(w, mask)
                if level == "token"
                else (losses.masked_mean(w, mask, -1) * rows).sum() / rows.sum().clamp_min(1e-8)
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
    losses.check_same_shape("rollout_rejection_mask", old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    x = torch.clamp(old_logp - rollout_logp, -SAFETY_BOUND, SAFETY_BOUND)  # [B, R]
    keep = torch.ones_like(x)  # [B, R]
    for option, (lo, hi) in zip(options, bounds, strict=True):
        k = {"1": -x, "2": 0.5 * x**2, "3": torch.exp(x) - 1.0 - x}[option[-1]]  # [B, R]
        if option.startswith("seq_max"):  # an empty row's -inf (veRL: 0) is harmless: no token to reject
            k = k.masked_fill(~mask.bool(), -math.inf).amax(-1, keepdim=True)  # [B, 1]
        elif option.startswith("seq_"):
            k = (_masked_sum(k, mask) if "sum" in option else losses.masked_mean(k, mask, -1))[:, None]  # [B, 1]
        ok = (k >= math.log(lo)) & (k <= math.log(hi)) if option[-1] == "1" else k <= hi  # [B, R] or [B, 1]
        keep = keep * ok.to(x.dtype)  # [B, R]
    return (mask * keep).to(mask.dtype)


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
                high = losses.masked_mean((raw > hi).float(), mask)
                low = losses.masked_mean((raw < lo).float(), mask)
            ess = losses.masked_mean((w / (losses.masked_mean(w, mask) + 1e-8)).square(), mask).item()
            ess = 1.0 / ess if ess else math.inf  # veRL raises ZeroDivisionError when every weight is 0
            out.update(
                rollout_is_mean=losses.masked_mean(w, mask),
                rollout_is_max=top,
                rollout_is_min=bottom,
                rollout_is_ratio_fraction_high=high,
                rollout_is_ratio_fraction_low=low,
                rollout_is_eff_sample_size=ess,
            )
        if new_mask is not None:
            kept = new_mask.to(old_logp.dtype)  # [B, R]
            out["rollout_rs_masked_fraction"] = losses.masked_mean(1.0 - kept, mask)
            out["rollout_rs_seq_masked_fraction"] = ((kept <= 0.5) & mask.bool()).any(-1).float().mean()
    return {key: float(value) for key, value in out.items()}

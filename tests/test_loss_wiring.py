"""grpo.grpo_loss_fn, the loss the update runs on each micro-batch, in every configuration where its paths differ:
every policy loss mode x every aggregation, each with the default seq-mean-token-sum-norm divisor and with
actor.loss_scale_factor set, each with and without the rollout correction's IS weights, against veRL's formulas
written out here (no losses.py): the loss value and its gradient with respect to the log-probs.

The micro-batch given to the loss is narrower than the generation budget (its rows end before
data.max_response_length) and is one part of a larger mini-batch (the global counts are not its own), as
token-budget micro-batching makes it: a divisor taken from the micro-batch's own width or rows instead of the
budget or the global counts, an ignored loss_scale_factor, or IS weights dropped by one mode all fail here, in
seconds. Bounds: fp32_noise.FACTOR x the fp32 noise of the same formulas measured at test time.
"""

import pytest
import torch

import config
import fp32_noise
import grpo
import grpo_family
import losses

MAX_RESPONSE = 16  # the generation budget; the micro-batch below is 6 wide
NUM_TOKENS, NUM_SEQS = 57.0, 10.0  # the mini-batch's global counts (this micro-batch holds 4 of its 10 rows)
CLIP_LOW, CLIP_HIGH, CLIP_C, TAU_POS, TAU_NEG = 0.2, 0.28, 3.0, 1.5, 1.05
ENTROPY_COEFF, KL_COEF = 0.01, 0.05
FACTORS = {"budget": None, "factor": 5.0}
LOSS_MODES = ("vanilla", *grpo_family.LOSS_MODES)  # actor.loss_scale_factor: unset (the budget), or set


def micro_batch(dtype) -> dict:
    """4 rows of 6 response positions: lengths 6, 3, 0 (an empty response) and 5 with a hole (a rejected
    token); log-probs 0.1 to 2 nats from the old ones (every clip and the dual clip fire), mixed advantages."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [0] * 6, [1, 1, 0, 1, 1, 0]], dtype=dtype)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3 - 0.5
    old = logp + (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5) * 4
    return {
        "logp": logp.to(dtype),
        "entropy": (torch.rand(4, 6, generator=g, dtype=torch.float64) * 2).to(dtype),
        "old_logprobs": old.to(dtype) * mask,
        "ref_logprobs": (logp + torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5).to(dtype) * mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=dtype)[:, None] * mask,
        "is_weights": (torch.rand(4, 6, generator=g, dtype=torch.float64) * 1.5 + 0.25).to(dtype) * mask,
        "response_mask": mask,
    }


def aggregate(x, mask, mode: str, divisor: float):
    """veRL's agg_loss with the global counts, written out."""
    if mode == "token-mean":
        return (x * mask).sum() / NUM_TOKENS
    if mode == "token-sum":
        return (x * mask).sum()
    if mode == "seq-mean-token-mean":
        return ((x * mask).sum(-1) / (mask.sum(-1) + 1e-8)).sum() / NUM_SEQS
    seq_mean = (x * mask).sum(-1).sum() / NUM_SEQS
    return seq_mean / divisor if mode == "seq-mean-token-sum-norm" else seq_mean


def policy_term(loss_mode: str, agg: str, divisor: float, b: dict, logp, weights):
    """veRL's compute_policy_loss_<mode> of the micro-batch with the global counts, IS weights multiplied in."""
    mask, adv, old = b["response_mask"], b["advantages"], b["old_logprobs"]
    d = logp - old
    ratio = d.clamp(-20, 20).exp()
    if loss_mode == "vanilla":
        loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
        clipped = torch.maximum(loss1, loss2)
        per_token = torch.where(adv < 0, torch.minimum(clipped, -adv * CLIP_C), clipped)
    elif loss_mode == "gspo":  # value exp(S_i) on every token, gradient through the token's own log-prob
        seq = (d * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        s = torch.exp((logp - logp.detach() + seq.detach()[:, None]).clamp(max=10))
        per_token = torch.maximum(-adv * s, -adv * s.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    elif loss_mode == "cispo":
        per_token = -ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH).detach() * adv * logp
    elif loss_mode == "sapo":  # always seq-mean-token-mean
        tau = torch.where(adv > 0, torch.tensor(TAU_POS, dtype=adv.dtype), torch.tensor(TAU_NEG, dtype=adv.dtype))
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
        return aggregate(per_token * weights, mask, "seq-mean-token-mean", divisor)
    else:  # geo_mean: one term per row, summed over the rows, over the mini-batch's row count
        n = mask.sum(-1) + 1e-8
        g = torch.where(adv > 0, d.clamp(max=CLIP_HIGH), torch.where(adv < 0, d.clamp(min=-CLIP_LOW), 0 * d))
        row_weight = torch.exp((torch.log(weights + 1e-10) * mask).sum(-1) / n)
        return (-(adv * mask).sum(-1) / n * torch.exp((g * mask).sum(-1) / n) * row_weight).sum() / NUM_SEQS
    return aggregate(per_token * weights, mask, agg, divisor)


def total_loss(loss_mode: str, agg: str, factor, weighted: bool, dtype) -> dict:
    """pg - entropy_coeff * entropy + kl_coef * low_var_kl, each aggregated as veRL's ppo_loss does; its value
    and its gradient with respect to the log-probs."""
    b = micro_batch(dtype)
    logp = b["logp"].clone().requires_grad_(True)
    mask = b["response_mask"]
    divisor = MAX_RESPONSE if factor is None else factor
    weights = b["is_weights"] if weighted else torch.ones_like(mask)
    k = (b["ref_logprobs"] - logp).clamp(-20, 20)
    kl = (k.exp() - k - 1).clamp(-10, 10)
    loss = (
        policy_term(loss_mode, agg, divisor, b, logp, weights)
        - ENTROPY_COEFF * aggregate(b["entropy"], mask, agg, divisor)
        + KL_COEF * aggregate(kl, mask, agg, divisor)
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return {"loss": loss.detach(), "grad": grad * mask}


def the_loss_fn(loss_mode: str, agg: str, factor, weighted: bool) -> dict:
    """grpo.grpo_loss_fn as update_actor builds it, on the float32 micro-batch."""
    overrides = [
        f"data.max_response_length={MAX_RESPONSE}",
        f"actor.policy_loss.loss_mode={loss_mode}",
        f"actor.loss_agg_mode={agg}",
        f"actor.clip_ratio_low={CLIP_LOW}",
        f"actor.clip_ratio_high={CLIP_HIGH}",
        f"actor.clip_ratio_c={CLIP_C}",
        f"actor.tau_pos={TAU_POS}",
        f"actor.tau_neg={TAU_NEG}",
        f"actor.entropy_coeff={ENTROPY_COEFF}",
        f"actor.kl_loss_coef={KL_COEF}",
        "actor.kl_loss_type=low_var_kl",
    ]
    if factor is not None:
        overrides.append(f"actor.loss_scale_factor={factor}")
    cfg = config.load_config(None, overrides)
    b = micro_batch(torch.float32)
    mb = {k: b[k] for k in ("old_logprobs", "ref_logprobs", "advantages", "response_mask")}
    if weighted:
        mb["is_weights"] = b["is_weights"]
    logp = b["logp"].clone().requires_grad_(True)
    loss_fn = grpo.grpo_loss_fn(cfg, grpo.choose_parts(cfg).policy_term)
    loss, _ = loss_fn(logp, b["entropy"], mb, {"num_tokens": NUM_TOKENS, "num_seqs": NUM_SEQS})
    (grad,) = torch.autograd.grad(loss, logp)
    return {"loss": loss.detach(), "grad": grad * b["response_mask"]}


# loss_scale_factor is read by seq-mean-token-sum-norm only
CASES = [
    (mode, agg, factor)
    for mode in LOSS_MODES
    for agg in losses.AGG_MODES
    for factor in FACTORS
    if factor == "budget" or agg == "seq-mean-token-sum-norm"
]


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "is_weights"])
@pytest.mark.parametrize("loss_mode,agg,factor", CASES)
def test_the_update_loss_equals_verls_formulas(loss_mode, agg, factor, weighted):
    scale = FACTORS[factor]
    ref, noise = fp32_noise.measure(lambda dtype: total_loss(loss_mode, agg, scale, weighted, dtype))
    got = the_loss_fn(loss_mode, agg, scale, weighted)
    what = f"{loss_mode} {agg} {factor} {'weighted' if weighted else ''}"
    for key in ("loss", "grad"):
        fp32_noise.check(got[key], ref[key], noise[key], f"{what} {key}")


def test_the_configurations_above_tell_the_paths_apart():
    """The test above could not pass with a wrong divisor, a missing factor or missing weights: in float64 the
    alternatives differ from the right value by far more than any fp32 noise."""
    budget = total_loss("vanilla", "seq-mean-token-sum-norm", None, False, torch.float64)["loss"]
    width = total_loss("vanilla", "seq-mean-token-sum-norm", 6.0, False, torch.float64)["loss"]  # the micro-batch's
    assert abs(budget - width) > 1e-3 * abs(budget)
    for mode in LOSS_MODES:
        plain = total_loss(mode, "token-mean", None, False, torch.float64)["grad"]
        weighted = total_loss(mode, "token-mean", None, True, torch.float64)["grad"]
        assert (plain - weighted).abs().max() > 1e-3, mode

"""grpo.py's step phases against an independent computation, at 1 and 2 ranks.

tests/helpers/loop_worker.py runs the advantages part (grpo.choose_parts), grpo.update_actor (fsdp_train.train_step with
grpo.grpo_loss_fn) and metrics.batch_metrics on a known batch under torchrun. Here the same quantities are
written out from veRL's formulas in plain PyTorch (one process, the whole batch, no losses.py), with
the recipe's regularisers on (entropy_coeff 0.003, low_var_kl 0.001), temperature 0.7, clip 0.2 / 0.28
and the dual clip firing.

The formulas run in float64 (the reference); the bounds are fp32_noise.FACTOR x the fp32 noise of the same
formulas in float32 at 1 and 2 threads (tests/helpers/fp32_noise.py). Measured (2 x86 cores, AVX-512): the code's
error / the noise at world sizes 1 and 2: the SGD step (= the gradient, read back from the weights; its noise
is the weights' rounding, 6e-8) 1.0-1.01, pg_loss <= 1.18, grad_norm <= 1.0, every other metric <= 0.77
(exactly 0 where the reference is: on-policy clip fractions and ppo_kl), advantages and batch metrics 0.11.

The rollout correction's wiring (loop_worker's corrected and bypass updates) is checked the same way: the
whole-batch IS weights and rejection mask each rank got back, the update over two mini-batches (SGD steps
1.0-1.05, metrics <= 0.6 x the noise), and bypass_mode's rejection against the current policy (<= 1.0).
"""

import copy
import functools
import math

import pytest
import torch
from loop_worker import (
    ADAPTIVE,
    BYPASS_RS,
    CORRECTION_RS,
    EMPTY_ROW,
    ESTIMATORS,
    FAMILY,
    GRID,
    HOLES,
    REWARDS,
    ROLLOUT_LOGPROB,
    empty_response,
    global_batch,
)
from transformers import AutoModelForCausalLM

import fp32_noise
from conftest import run_torchrun

TEMPERATURE, CLIP_LOW, CLIP_HIGH, CLIP_C, ENTROPY_COEFF, KL_COEF = 0.7, 0.2, 0.28, 3.0, 0.003, 0.001
MAX_PROMPT, MAX_RESPONSE = 8, 12
# Worked by hand: (r - mean) / (std + 1e-6) with the unbiased std, per group of 4 (veRL's epsilon):
#   [1,0,0,0]: mean 1/4, std 1/2;  [1,1,0,0]: mean 1/2, std 1/sqrt(3);  [0,0,0,0]: 0;  [1,1,1,0]: mean 3/4, std 1/2
S3 = 1 / math.sqrt(3)
DEVIATIONS = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 0.25, -0.75]
STDS = [0.5] * 4 + [S3] * 4 + [0.0] * 4 + [0.5] * 4
ADVANTAGES = [d / (s + 1e-6) for d, s in zip(DEVIATIONS, STDS, strict=True)]
MODES = ("off_policy", "on_policy", "seq_mean_empty", *FAMILY)
TAU_POS, TAU_NEG, SCALE_FACTOR = 1.5, 1.05, 5.0  # FAMILY's sapo and sum_norm


# FAMILY and the default modes -> (loss mode, aggregation, clip_ratio_low, seq-mean-token-sum-norm's divisor)
SETTINGS = {
    "gspo": ("gspo", "seq-mean-token-mean", CLIP_LOW, None),
    "cispo": ("cispo", "token-mean", 10.0, None),  # clip_ratio_low 10: only the upper bound 1 + CLIP_HIGH acts
    "sapo": ("sapo", "token-mean", CLIP_LOW, None),
    "geo_mean": ("geo_mean", "token-mean", CLIP_LOW, None),
    "token_sum": ("vanilla", "token-sum", CLIP_LOW, None),
    "sum_norm": ("vanilla", "seq-mean-token-sum-norm", CLIP_LOW, SCALE_FACTOR),
    "seq_mean_empty": ("vanilla", "seq-mean-token-mean", CLIP_LOW, None),
}


def aggregate(agg: str, x, mask, divisor: float | None = None):
    """veRL's agg_loss written out over the whole batch (the seq-mean modes count all 16 rows);
    seq-mean-token-sum-norm divides by `divisor`, by default the generation budget MAX_RESPONSE."""
    if agg == "seq-mean-token-mean":
        return ((x * mask).sum(-1) / (mask.sum(-1) + 1e-8)).sum() / 16
    if agg == "token-sum":
        return (x * mask).sum()
    if agg == "seq-mean-token-sum":
        return (x * mask).sum(-1).sum() / 16
    if agg == "seq-mean-token-sum-norm":
        return (x * mask).sum(-1).sum() / 16 / (divisor or MAX_RESPONSE)
    return (x * mask).sum() / mask.sum()


def policy_term(loss_mode: str, agg: str, logp, old, adv, mask, clip_low=CLIP_LOW, divisor=None) -> tuple:
    """(pg_loss, its metrics) of the loss mode, veRL's formula over the whole batch."""
    d = logp - old  # [B, R]
    ratio = d.clamp(-20, 20).exp()

    def token_mean(x):
        return (x * mask).sum() / mask.sum()

    if loss_mode == "gspo":  # the sequence's mean log-ratio as every token's ratio (value), gradient via its logp
        seq = (d * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        s = torch.exp(seq.detach()[:, None].clamp(max=10)) * torch.exp(logp - logp.detach())
        loss1, loss2 = -adv * s, -adv * s.clamp(1 - clip_low, 1 + CLIP_HIGH)
        pg = aggregate(agg, torch.maximum(loss1, loss2), mask, divisor)
        return pg, {"actor/pg_clipfrac": token_mean((loss2 > loss1).float()), "actor/ppo_kl": token_mean(-d)}
    if loss_mode == "cispo":
        c = ratio.clamp(1 - clip_low, 1 + CLIP_HIGH)
        pg = aggregate(agg, -c.detach() * adv * logp, mask, divisor)
        return pg, {
            "actor/pg_clipfrac": token_mean((ratio != c).float()),
            "actor/ppo_kl": token_mean(-d.clamp(-20, 20)),
        }
    if loss_mode == "sapo":  # always seq-mean-token-mean over all 16 rows
        tau = torch.where(adv > 0, TAU_POS, TAU_NEG)
        gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
        pg = aggregate("seq-mean-token-mean", -gate * adv, mask)
        return pg, {"actor/pg_clipfrac": torch.zeros(()), "actor/ppo_kl": token_mean(-d.clamp(-20, 20))}
    if loss_mode == "geo_mean":  # per row: exp(mean of the log-ratios clipped by the sign of A), times the mean A
        n = mask.sum(-1) + 1e-8
        g = torch.where(adv > 0, d.clamp(max=CLIP_HIGH), torch.where(adv < 0, d.clamp(min=-clip_low), 0 * d))
        pg = (-(adv * mask).sum(-1) / n * torch.exp((g * mask).sum(-1) / n)).mean()  # over all 16 rows
        outside = (d < -clip_low) | (d > CLIP_HIGH)
        return pg, {
            "actor/pg_clipfrac": token_mean((outside & (adv > 0)).float()),
            "actor/pg_clipfrac_lower": token_mean((outside & (adv < 0)).float()),
            "actor/ppo_kl": token_mean(-d),
        }
    pg, upper, lower, ppo_kl = ppo_terms(logp, old, adv, clip_low)
    return aggregate(agg, pg, mask, divisor), {
        "actor/pg_clipfrac": token_mean(upper),
        "actor/pg_clipfrac_lower": token_mean(lower),
        "actor/ppo_kl": token_mean(ppo_kl),
    }


def forward(model, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) [B, R] of the batch's responses at TEMPERATURE, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    r = b["response_mask"].shape[1]
    position_ids = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=position_ids).logits
    z = logits[:, -r - 1 : -1].to(dtype) / TEMPERATURE  # [B, R, V]: position t predicts token t + 1
    logp = torch.log_softmax(z, -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]  # [B, R]
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)  # [B, R]
    return logp, entropy


def ppo_terms(logp, old, adv, clip_low=CLIP_LOW) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """veRL's compute_policy_loss_vanilla per token [B, R]: (loss after both clips, clipped above (0/1),
    dual-clipped (0/1), -log ratio)."""
    log_ratio = (logp - old).clamp(-20, 20)
    ratio = log_ratio.exp()
    loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + CLIP_HIGH)
    clipped, loss3 = torch.maximum(loss1, loss2), -adv * CLIP_C
    pg = torch.where(adv < 0, torch.minimum(loss3, clipped), clipped)
    return pg, (loss2 > loss1).to(logp.dtype), ((clipped > loss3) & (adv < 0)).to(logp.dtype), -log_ratio


def low_var_kl(logp, ref) -> torch.Tensor:
    k = (ref - logp).clamp(-20, 20)
    return (k.exp() - k - 1).clamp(-10, 10)


def in_dtype(b: dict, dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()}


def sgd_step(model) -> fp32_noise.Flat:
    """One SGD step of lr 1 on the accumulated gradients, as the worker's; returns before - after (= the gradient)."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return fp32_noise.Flat({name: before[name] - p.detach() for name, p in model.named_parameters()})


def grad_norm(model) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))


def reference(model, mode: str, settings: tuple | None = None) -> dict:
    """The metrics and the SGD step (lr 1: before - after = the gradient) of one update on the whole batch,
    from the formulas, in the model's dtype (float64: the reference; float32: measures the fp32 noise,
    tests/helpers/fp32_noise.py). Returns {metric: value, "step": {name: before - after}}. seq_mean_empty: row
    EMPTY_ROW has no response tokens and the loss terms are seq-mean-token-mean over ALL 16 rows. FAMILY
    modes: off-policy, with that loss mode or aggregation (tests/helpers/loop_worker.py). settings: (loss mode,
    aggregation, clip_ratio_low, divisor) instead of SETTINGS[mode] (the GRID)."""
    on_policy, seq_mean_empty = mode == "on_policy", mode == "seq_mean_empty"
    dtype = next(model.parameters()).dtype
    b = global_batch(model.config.vocab_size)
    b = in_dtype(empty_response(b, EMPTY_ROW) if seq_mean_empty else b, dtype)
    logp, entropy = forward(model, b)
    mask = b["response_mask"]

    def token_mean(x):
        return (x * mask).sum() / mask.sum()

    adv = torch.tensor(ADVANTAGES, dtype=dtype)[:, None] * mask  # [B, R]
    old = logp.detach() if on_policy else b["old_logprobs"]
    loss_mode, agg, clip_low, divisor = settings or SETTINGS.get(mode, ("vanilla", "token-mean", CLIP_LOW, None))
    pg, metrics = policy_term(loss_mode, agg, logp, old, adv, mask, clip_low, divisor)
    kl = low_var_kl(logp, b["ref_logprobs"])
    # the entropy and KL terms: actor.loss_agg_mode, whatever the loss mode
    entropy_term, kl_term = aggregate(agg, entropy, mask, divisor), aggregate(agg, kl, mask, divisor)
    loss = pg - ENTROPY_COEFF * entropy_term + KL_COEF * kl_term
    model.zero_grad(set_to_none=True)
    loss.backward()
    metrics = {
        "actor/pg_loss": pg,
        "actor/kl_loss": kl_term,
        "actor/pg_clipfrac_lower": torch.zeros(()),
        **metrics,
        "actor/grad_norm": grad_norm(model),
    }
    if on_policy:  # what the skipped old-log-prob pass would have logged
        diff = (logp - ROLLOUT_LOGPROB).abs() * mask
        metrics.update(
            {
                "actor/entropy": token_mean(entropy),
                "rollout/logprob_diff_max": diff.max(),
                "rollout/logprob_diff_mean": diff.sum() / mask.sum(),
            }
        )
    step = sgd_step(model)  # as the worker: the step is read back from the weights
    return {**{k: float(v.detach()) for k, v in metrics.items()}, "step": step}


def correction(b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """loop_worker.CORRECTION over the WHOLE batch, from veRL's formulas: (truncated IS weights, the same
    normalised by their mean over every sampled token, the response mask after rejection), each [B, R].
    Token IS: w = min(exp(old - rollout), 2); token_k1 rejection keeps a token iff
    1/CORRECTION_RS <= exp(old - rollout) <= CORRECTION_RS."""
    sampled = b["response_mask"]  # every sampled token (the batch has no holes yet)
    d = b["old_logprobs"] - b["rollout_logprobs"]  # [B, R], within +-20 here
    truncated = d.exp().clamp(max=2.0) * sampled
    normalised = truncated / ((truncated * sampled).sum() / (sampled.sum() + 1e-8))
    keep = (d.abs() <= math.log(CORRECTION_RS)).to(d.dtype)
    return truncated, normalised, sampled * keep


def sequential_updates(model, b: dict, mask, w, parts: tuple) -> dict:
    """One SGD step (lr 1) per part of the batch, in order, each on the weights the previous one moved: the
    token mean over the part's kept tokens (mask) of w * pg - ENTROPY_COEFF * entropy + KL_COEF * kl, with
    the off-policy old log-probs and ADVANTAGES over the kept tokens. Metrics: the mean over the steps (as
    veRL's update_policy logs them); the step: before - after over all of them."""
    dtype = next(model.parameters()).dtype
    adv = torch.tensor(ADVANTAGES, dtype=dtype)[:, None] * mask  # [B, R]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sums = {}
    for rows in parts:
        logp, entropy = forward(model, {k: v[rows] for k, v in b.items()})
        m = mask[rows]

        def mean(x, m=m):
            return (x * m).sum() / m.sum()

        pg, upper, lower, ppo_kl = ppo_terms(logp, b["old_logprobs"][rows], adv[rows])
        kl = low_var_kl(logp, b["ref_logprobs"][rows])
        loss = mean(w[rows] * pg) - ENTROPY_COEFF * mean(entropy) + KL_COEF * mean(kl)
        model.zero_grad(set_to_none=True)
        loss.backward()
        values = {"actor/pg_loss": mean(w[rows] * pg), "actor/kl_loss": mean(kl), "actor/ppo_kl": mean(ppo_kl)}
        values.update({"actor/pg_clipfrac": mean(upper), "actor/pg_clipfrac_lower": mean(lower)})
        values["actor/grad_norm"] = grad_norm(model)
        for k, v in values.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach()) / len(parts)
        sgd_step(model)
    step = fp32_noise.Flat({name: before[name] - p.detach() for name, p in model.named_parameters()})
    return {**sums, "step": step}


def corrected_reference(model) -> dict:
    """loop_worker.corrected_update from the formulas: the correction above, advantages over the surviving
    tokens, then one SGD step per mini-batch of 2 prompts: rows 0-7, then rows 8-15 on the moved weights."""
    b = in_dtype(global_batch(model.config.vocab_size), next(model.parameters()).dtype)
    _, w, mask = correction(b)
    return sequential_updates(model, b, mask, w, (slice(0, 8), slice(8, 16)))


def two_epochs_reference(model) -> dict:
    """loop_worker's two_epochs update (actor.ppo_epochs=2, one mini-batch) from the formulas: two SGD steps on
    the whole batch, the second on the weights the first moved, both against the same old log-probs."""
    b = in_dtype(global_batch(model.config.vocab_size), next(model.parameters()).dtype)
    mask = b["response_mask"]
    return sequential_updates(model, b, mask, torch.ones_like(mask), (slice(0, 16), slice(0, 16)))


def margin(log_ratio, mask, threshold: float) -> float:
    """How close the tokens' |log-ratio| come to a token_k1 bound ln(threshold)."""
    return (log_ratio.abs() - math.log(threshold)).abs()[mask.bool()].min().item()


def bypass_reference(model) -> dict:
    """loop_worker.bypass_update from the formulas (veRL's compute_policy_loss_bypass_mode, loss_type ppo_clip):
    the old log-probs are vLLM's (ROLLOUT_LOGPROB); the policy term keeps a token iff
    1/BYPASS_RS <= exp(logp - ROLLOUT_LOGPROB) <= BYPASS_RS under the CURRENT policy (detached) and is
    still divided by every response token, as the KL and entropy terms are; no IS weights."""
    dtype = next(model.parameters()).dtype
    b = in_dtype(global_batch(model.config.vocab_size), dtype)
    logp, entropy = forward(model, b)
    mask = b["response_mask"]
    x = (logp.detach() - ROLLOUT_LOGPROB).abs()  # [B, R]: |log pi / pi_vLLM| under the current policy
    kept = mask * (x <= math.log(BYPASS_RS)).to(dtype)

    def mean(x):
        return (x * mask).sum() / mask.sum()

    adv = torch.tensor(ADVANTAGES, dtype=dtype)[:, None] * mask  # [B, R]
    pg, _, _, _ = ppo_terms(logp, ROLLOUT_LOGPROB * mask, adv)
    kl = low_var_kl(logp, b["ref_logprobs"])
    loss = mean(pg * kept) - ENTROPY_COEFF * mean(entropy) + KL_COEF * mean(kl)
    model.zero_grad(set_to_none=True)
    loss.backward()
    metrics = {"actor/pg_loss": mean(pg * kept), "actor/kl_loss": mean(kl), "actor/grad_norm": grad_norm(model)}
    info = {"rejected": (mask - kept).sum().item(), "tokens": mask.sum().item()}
    info["margin"] = margin(x, mask, BYPASS_RS)  # no token near the bound: fp32 and float64 decide alike
    return {**{k: float(v.detach()) for k, v in metrics.items()}, "step": sgd_step(model), **info}


REFERENCES = {"corrected": corrected_reference, "bypass": bypass_reference, "two_epochs": two_epochs_reference}


@pytest.fixture(scope="module")
def references(random_models):
    """mode -> (reference, noise): reference() in float64 and how far fp32 lands from it at 1 and 2 threads."""
    model = AutoModelForCausalLM.from_pretrained(random_models["tied"], dtype=torch.float32)
    cache = {}

    def get(mode):
        """mode: a MODES or REFERENCES name, or a GRID entry (loss mode, aggregation)."""
        if mode not in cache:
            if isinstance(mode, tuple):
                compute = functools.partial(reference, mode="grid", settings=(*mode, CLIP_LOW, None))
            else:
                compute = REFERENCES.get(mode, functools.partial(reference, mode=mode))
            cache[mode] = fp32_noise.measure(
                lambda dtype: compute(
                    fp32_noise.float64_copy(model) if dtype == torch.float64 else copy.deepcopy(model)
                )
            )
        return cache[mode]

    return get


def plain_advantages(dtype) -> torch.Tensor:
    """[16]: (r - mean) / (std + 1e-6) per group of 4 (unbiased std), written out in dtype."""
    r = torch.tensor(REWARDS, dtype=dtype).view(4, 4)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)).flatten()


def expected_batch_metrics(advantages: list[float]) -> dict:
    b = global_batch(100)
    resp = b["response_mask"].sum(-1).tolist()
    prompt = b["attention_mask"].sum(-1).sub(b["response_mask"].sum(-1)).tolist()
    adv_tokens = [a for a, n in zip(advantages, resp, strict=True) for _ in range(int(n))]
    out = {}
    for key, values in (
        ("critic/score", REWARDS),
        ("critic/rewards", REWARDS),
        ("critic/advantages", adv_tokens),
        ("critic/returns", adv_tokens),
        ("response_length", resp),
        ("prompt_length", prompt),
    ):
        out.update({f"{key}/mean": sum(values) / len(values), f"{key}/max": max(values), f"{key}/min": min(values)})
    out["response_length/clip_ratio"] = sum(n >= MAX_RESPONSE for n in resp) / len(resp)
    out["prompt_length/clip_ratio"] = sum(n >= MAX_PROMPT for n in prompt) / len(prompt)
    total = sum(resp) + sum(prompt)
    out.update(
        {
            "perf/total_num_tokens": total,
            "timing_per_token_ms/gen": 2.0 * 1000 / sum(resp),
            "timing_per_token_ms/update_actor": 3.0 * 1000 / total,
        }
    )
    return out


@pytest.fixture(scope="module")
def batch_references():
    """(reference, noise) of the advantages and the batch metrics: computed from the advantages in float64, and
    from the advantages in fp32 (the metrics themselves are Python floats, as in metrics.batch_metrics)."""
    assert plain_advantages(torch.float64).tolist() == pytest.approx(ADVANTAGES, abs=1e-15)  # = the hand values
    return fp32_noise.measure(
        lambda dtype: {
            "advantages": plain_advantages(dtype),
            **expected_batch_metrics(plain_advantages(dtype).tolist()),
        }
    )


@pytest.fixture(scope="module")
def runs(random_models, tmp_path_factory):
    """{world: (per-rank reports, out dir)} for 1 and 2 ranks."""
    out = {}
    for world in (1, 2):
        folder = tmp_path_factory.mktemp(f"loop{world}")
        out[world] = (run_torchrun("loop_worker.py", world, random_models["tied"], str(folder)), folder)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_advantages_are_group_normalised_rewards(runs, batch_references, world):
    reports, _ = runs[world]
    ref, noise = batch_references
    b = global_batch(100)
    for rep in reports:
        for row, adv in zip(rep["rows"], rep["advantages"], strict=True):
            length = int(b["response_mask"][row].sum())
            fp32_noise.check(
                torch.tensor(adv[:length]), ref["advantages"][row].expand(length), noise["advantages"], f"row {row}"
            )  # broadcast over tokens
            assert all(a == 0.0 for a in adv[length:])  # and masked beyond
    assert sorted(row for rep in reports for row in rep["rows"]) == list(range(16))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_update_matches_the_formulas(runs, references, world, mode):
    """Every metric and every parameter's gradient (the SGD step) equal the float64 formulas within FACTOR x
    the fp32 noise measured on this machine (tests/helpers/fp32_noise.py)."""
    reports, folder = runs[world]
    ref, noise = references(mode)
    if mode == "off_policy":  # the batch really exercises every branch of the loss
        assert ref["actor/pg_clipfrac"] > 0.1 and ref["actor/pg_clipfrac_lower"] > 0.05
    for rep in reports:
        for key in ref:
            if key != "step":
                fp32_noise.check(rep[mode][key], ref[key], noise[key], f"world {world} {mode} {key}")
        assert rep[mode]["actor/kl_coef"] == KL_COEF
    weights = torch.load(folder / f"{mode}_ws{world}.pt")
    assert max(g.abs().max().item() for g in ref["step"].values()) > 1e-3  # the gradient is not trivially zero
    step = {name: weights["before"][name] - weights["after"][name] for name in ref["step"]}
    fp32_noise.check(step, ref["step"], noise["step"], f"world {world} {mode} gradient")


@pytest.fixture(scope="module")
def grid_weights(runs):
    """world -> loop_worker.grid's saved weights (read once)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = torch.load(runs[world][1] / f"grid_ws{world}.pt")
        return cache[world]

    return get


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("loss_mode,agg", GRID)
def test_every_loss_and_aggregation_is_the_formula_whatever_the_micro_batches(
    runs, references, grid_weights, world, loss_mode, agg
):
    """Every actor.policy_loss.loss_mode x every actor.loss_agg_mode (seq-mean-token-sum-norm with its default
    divisor, the generation budget): one update under a token budget of ~2 rows per micro-batch (micro-batches
    of different widths and row counts) gives the float64 formulas' gradient over the whole batch; and the
    same update with all of a rank's rows in one micro-batch gives the same weights, within FACTOR x the fp32
    noise of that gradient. A divisor taken from a micro-batch's width or rows fails both."""
    ref, noise = references((loss_mode, agg))
    weights = grid_weights(world)
    after = weights["after"][f"{loss_mode} {agg}"]
    step = {name: weights["before"][name] - after[name] for name in ref["step"]}
    fp32_noise.check(step, ref["step"], noise["step"], f"world {world} {loss_mode} {agg} gradient")
    for rep in runs[world][0]:
        difference = rep["grid"][f"{loss_mode} {agg}"]
        allowed = fp32_noise.FACTOR * noise["step"] + fp32_noise.FLOOR
        assert difference <= allowed, (
            f"world {world} {loss_mode} {agg}: the two budgets' weights differ by {difference:.3g}"
        )


def adaptive_rewards(dtype) -> dict:
    """loop_worker.ADAPTIVE over two steps, from veRL's formulas (apply_kl_penalty, AdaptiveKLController.update):
    kl_it = |old - ref| on every sampled token, each step's rewards = the score at the last token - beta * kl,
    the logged KL the mean over all 16 rows of each row's token mean, and beta_2 = beta_1 (1 + e * 16 / horizon),
    e = clip(kl / target - 1, -0.2, 0.2): the WHOLE batch's row count, at any world size."""
    b = in_dtype(global_batch(100), dtype)
    sampled = b["response_mask"]
    kl = (b["old_logprobs"] - b["ref_logprobs"]).abs() * sampled
    scores = torch.zeros_like(sampled)
    scores[torch.arange(16), sampled.sum(-1).long() - 1] = torch.tensor(REWARDS, dtype=dtype)
    current = (kl.sum(-1) / (sampled.sum(-1) + 1e-8)).mean().item()
    beta = 0.05
    second = beta * (1 + min(max(current / 0.1 - 1, -0.2), 0.2) * 16 / 40)
    return {"kl": current, "beta_2": second, "step_1": scores - beta * kl, "step_2": scores - second * kl}


@pytest.mark.parametrize("world", [1, 2])
def test_the_adaptive_kl_coefficient_moves_the_rewards_and_counts_every_rank(runs, world):
    """Two steps of the KL in the reward with the adaptive controller: step 1 logs and applies kl_coef; step 2
    the coefficient veRL's controller gives after step 1's KL over the WHOLE batch's 16 rows (at 2 ranks too),
    and that coefficient, not the configured one, is what the dumped rewards of step 2 subtract."""
    assert ADAPTIVE[1:] == [  # what adaptive_rewards writes out
        "algorithm.kl_penalty=abs",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.target_kl=0.1",
        "algorithm.kl_ctrl.horizon=40",
    ]
    reports, folder = runs[world]
    ref, noise = fp32_noise.measure(adaptive_rewards)
    assert ref["beta_2"] != 0.05 and ref["kl"] > 0.12  # the controller moves, its clip binds: beta_2 exact
    for rep in reports:
        first, second = rep["adaptive"]
        assert first["actor/reward_kl_penalty_coeff"] == 0.05
        fp32_noise.check(first["actor/reward_kl_penalty"], ref["kl"], noise["kl"], f"world {world} step 1 KL")
        assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(ref["beta_2"], rel=1e-12)
    for step in (1, 2):
        dump = torch.load(folder / "dump_adaptive" / f"step_{step}.pt")
        key = f"step_{step}"
        fp32_noise.check(dump["token_level_rewards"], ref[key], noise[key], f"world {world} rewards of step {step}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["corrected", "bypass"])
def test_the_rollout_correction_reaches_the_update(runs, references, world, mode):
    """corrected: the IS weights multiply the policy term and the rejected tokens leave every term, in two
    mini-batches (at 2 ranks each rank trains its own, non-contiguous rows of the whole-batch correction);
    bypass: the rejection is taken against the CURRENT policy's log-probs, and rejects. The metrics and the
    gradient (over both SGD steps) equal the float64 formulas within FACTOR x the fp32 noise."""
    reports, folder = runs[world]
    ref, noise = references(mode)
    if mode == "bypass":  # the current policy's ratios straddle the bounds, clear of them
        assert 0 < ref["rejected"] < ref["tokens"] and ref["margin"] > 1e-4, ref
    for rep in reports:
        got = rep[mode]["update"] if mode == "corrected" else rep[mode]
        for key in (k for k in ref if k.startswith("actor/")):
            fp32_noise.check(got[key], ref[key], noise[key], f"world {world} {mode} {key}")
    weights = torch.load(folder / f"{mode}_ws{world}.pt")
    step = {name: weights["before"][name] - weights["after"][name] for name in ref["step"]}
    fp32_noise.check(step, ref["step"], noise["step"], f"world {world} {mode} gradient")


@pytest.fixture(scope="module")
def correction_references(random_models):
    """(reference, noise) of the whole-batch correction (test_loop.correction) and of its metrics."""
    vocab = AutoModelForCausalLM.from_pretrained(random_models["tied"]).config.vocab_size

    def compute(dtype):
        b = in_dtype(global_batch(vocab), dtype)
        truncated, weights, mask = correction(b)
        sampled = b["response_mask"]
        return {
            "is_weights": weights,
            "response_mask": mask,
            "rollout_corr/rollout_is_mean": ((truncated * sampled).sum() / sampled.sum()).item(),
            "rollout_corr/rollout_rs_masked_fraction": ((sampled - mask).sum() / sampled.sum()).item(),
            "rollout_corr/rollout_rs_seq_masked_fraction": ((sampled - mask).sum(-1) > 0).double().mean().item(),
            "critic/advantages/mean": (
                (torch.tensor(ADVANTAGES, dtype=dtype)[:, None] * mask).sum() / mask.sum()
            ).item(),
            "margin": margin(b["old_logprobs"] - b["rollout_logprobs"], sampled, CORRECTION_RS),
        }

    return fp32_noise.measure(compute)


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_gets_its_own_rows_of_the_whole_batch_correction(runs, correction_references, world):
    """grpo.correct_rollout computes the IS weights (normalised over the WHOLE batch) and the rejection mask on
    every rank's rows together and hands each rank back its own: at 2 ranks with two mini-batches rank 0 holds
    rows 0-3 and 8-11, not a contiguous half. Each rank's weights and mask, and the logged rollout_corr/*
    metrics, equal the whole-batch formulas; the rejection removes some tokens but not all."""
    ref, noise = correction_references
    assert ref["margin"] > 1e-4  # no log-ratio at the rejection bound: fp32 and float64 decide alike
    sampled, mask = global_batch(100)["response_mask"], ref["response_mask"]
    assert 0 < (sampled - mask).sum() < sampled.sum() / 2  # some tokens rejected, most kept
    reports = runs[world][0]
    if world == 2:
        assert reports[0]["corrected"]["rows"] == [0, 1, 2, 3, 8, 9, 10, 11]
    for rep in reports:
        got, rows = rep["corrected"], rep["corrected"]["rows"]
        width = len(got["response_mask"][0])
        assert mask[rows, width:].sum() == 0  # the rank's rows end within its width
        assert torch.equal(torch.tensor(got["response_mask"]), mask[rows, :width].float())
        fp32_noise.check(
            torch.tensor(got["is_weights"]), ref["is_weights"][rows, :width], noise["is_weights"], f"world {world} IS"
        )
        for key in (k for k in ref if k.startswith("rollout_corr/")):
            fp32_noise.check(got["correction"][key], ref[key], noise[key], f"world {world} {key}")
    assert sorted(row for rep in reports for row in rep["corrected"]["rows"]) == list(range(16))


@pytest.mark.parametrize("world", [1, 2])
def test_lengths_count_every_sampled_token_after_rejection(runs, correction_references, world):
    """After rejection the response mask has holes, yet response_length/* counts every sampled token (veRL's
    compute_data_metrics reads the attention mask); critic/advantages/* are over the surviving tokens only."""
    ref, noise = correction_references
    lengths = global_batch(100)["response_mask"].sum(-1)  # [16]: every sampled token
    assert not torch.equal(ref["response_mask"].sum(-1), lengths.double())  # rejection shortened some rows
    for rep in runs[world][0]:
        m = rep["corrected"]["batch_metrics"]
        assert m["response_length/mean"] == pytest.approx(lengths.mean().item(), rel=1e-12)
        assert (m["response_length/max"], m["response_length/min"]) == (lengths.max(), lengths.min())
        key = "critic/advantages/mean"
        fp32_noise.check(m[key], ref[key], noise[key], f"world {world} {key}")


@pytest.mark.parametrize("world", [1, 2])
def test_batch_metrics_are_global_values(runs, batch_references, world):
    ref, noise = batch_references
    for rep in runs[world][0]:
        for key, value in ref.items():
            if key != "advantages":
                fp32_noise.check(rep["batch_metrics"][key], value, noise[key], f"world {world} {key}")


@pytest.mark.parametrize("world", [1, 2])
def test_lr_schedule_and_logged_lr_follow_verl(runs, world):
    """veRL 0.9.1: warmup factor = step / W, so the FIRST update runs at lr 0 and changes nothing;
    actor/lr is read after the schedule steps (the next update's lr). The schedule steps once per GLOBAL
    step, however many mini-batches (optimizer steps) it has. Worked by hand for lr 0.01:
    constant, W = 2, one mini-batch per step:        updates at 0, 0.5, 1, 1;  logged 0.5, 1, 1, 1
    cosine, W = int(0.5 * 4 steps) = 2, min_lr_ratio 0.1, two mini-batches per step:
                                       updates at 0, 0, 0.5, 0.5, 1, 1, 0.55, 0.55;  logged 0.5, 1, 0.55, 0.1
    (cosine factor at step s >= W: 0.1 + 0.9 * (1 + cos(pi * (s - 2) / 2)) / 2). A schedule stepped per
    mini-batch would run the cosine updates at 0, 0.5, 1, 0.55, 0.1, ... and log 1, 0.1, ..."""
    for rep in runs[world][0]:
        assert rep["constant"]["step_lrs"] == pytest.approx([0.0, 0.005, 0.01, 0.01])
        assert rep["constant"]["lr"] == pytest.approx([0.005, 0.01, 0.01, 0.01])
        assert rep["cosine"]["step_lrs"] == pytest.approx([0.0, 0.0, 0.005, 0.005, 0.01, 0.01, 0.0055, 0.0055])
        assert rep["cosine"]["lr"] == pytest.approx([0.005, 0.01, 0.0055, 0.001])
        for name in ("constant", "cosine"):
            assert rep[name]["unchanged"] == [True, False, False, False]


# ------------------------------------------------------------------------------ advantage estimators
KL_BETA, GAMMA = 0.05, 0.9  # loop_worker.ESTIMATORS' kl_ctrl.kl_coef and rf_kl's gamma


def whiten(x, mask):
    """veRL's masked_whiten written out: over every kept token of the batch, unbiased, its 1e-8s."""
    values = x[mask.bool()]
    n = values.numel()
    mean = values.sum() / (n + 1e-8)
    var = ((values - mean) ** 2).sum() / (n + 1e-8) * n / (n - 1)
    return (x - mean) / torch.sqrt(var + 1e-8) * mask


def discounted_returns(rewards, mask, gamma):
    """G_t = r_t + gamma G_next over the kept tokens, from the last; a rejected token passes G on."""
    returns = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = torch.zeros((), dtype=rewards.dtype)
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = rewards[i, t] + gamma * running
                returns[i, t] = running
    return returns


def estimator_reference(name: str, dtype) -> dict:
    """veRL's apply_kl_penalty + compute_advantage for loop_worker.ESTIMATORS[name], written out in dtype on the
    whole batch with loop_worker.HOLES rejected: the scores at each response's last token, minus KL_BETA times the
    old-vs-reference KL on every SAMPLED token (rejected ones too); then the estimator over the kept tokens."""
    b = global_batch(100)
    sampled = b["response_mask"].to(dtype)  # [16, R]
    mask = sampled.clone()
    for row, token in HOLES:
        mask[row, token] = 0.0
    rewards = torch.zeros_like(sampled)
    rewards[torch.arange(16), sampled.sum(-1).long() - 1] = torch.tensor(REWARDS, dtype=dtype)
    out = {}
    if "algorithm.use_kl_in_reward=true" in ESTIMATORS[name]:
        x = (b["old_logprobs"] - b["ref_logprobs"]).to(dtype)
        kl = ((-x).exp() + x - 1).clamp(-10, 10) if name == "grpo_kl" else x  # low_var_kl, or kl (k1)
        kl = kl * sampled
        rewards = rewards - KL_BETA * kl
        out["actor/reward_kl_penalty"] = (kl.sum(-1) / (sampled.sum(-1) + 1e-8)).mean().item()
    r = rewards.sum(-1).view(4, 4)  # [prompts, n]
    if name.startswith("rloo"):
        per_row = r - (r.sum(-1, keepdim=True) - r) / 3  # minus the mean of the other three
        advantages = returns = per_row.reshape(16, 1) * mask
    elif name == "rf_baseline":
        advantages = returns = whiten((r - r.mean(-1, keepdim=True)).reshape(16, 1) * mask, mask)
    elif name == "rf_kl":
        returns = discounted_returns(rewards, mask, GAMMA)
        advantages = whiten(returns, mask)
    else:  # grpo
        advantages = returns = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)).reshape(16, 1) * mask
    for key, values in (("critic/rewards", rewards.sum(-1)), ("critic/returns", returns[mask.bool()])):
        out.update({f"{key}/mean": values.mean().item(), f"{key}/max": values.max().item()})
        out[f"{key}/min"] = values.min().item()
    return {**out, "token_level_rewards": rewards, "advantages": advantages, "returns": returns}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_dumped_advantages_of_each_estimator_equal_the_formulas(runs, world, name):
    """The GRPO family's advantages part (whole-batch whitening, the KL in the reward before rejection) and
    data.dump_batch at 1 and 2 ranks: the dumped per-token rewards, advantages and returns, the response mask with
    its rejected tokens, and the logged KL metrics equal veRL's formulas within FACTOR x the fp32 noise."""
    reports, folder = runs[world]
    ref, noise = fp32_noise.measure(lambda dtype: estimator_reference(name, dtype))
    dump = torch.load(folder / f"dump_{name}" / "step_1.pt")
    for key in ("token_level_rewards", "advantages", "returns"):
        fp32_noise.check(dump[key], ref[key], noise[key], f"world {world} {name} {key}")
    assert [(r, t) for r, t in HOLES if dump["response_mask"][r, t] == 0] == HOLES
    for rep in reports:
        metrics = rep["estimators"][name]
        for key in (k for k in ref if k.startswith("critic/")):  # the rewards after the KL, the unwhitened returns
            fp32_noise.check(metrics["batch"][key], ref[key], noise[key], f"world {world} {name} {key}")
        if "actor/reward_kl_penalty" in ref:
            key = "actor/reward_kl_penalty"
            fp32_noise.check(metrics[key], ref[key], noise[key], f"world {world} {name} {key}")
            assert metrics["actor/reward_kl_penalty_coeff"] == KL_BETA
        else:
            assert set(metrics) == {"batch"}


def test_the_estimators_are_told_apart_by_this_batch():
    """A mixed-up estimator (or a KL term left out) would fail the test above: their advantages all differ."""
    advantages = {name: estimator_reference(name, torch.float64)["advantages"] for name in ESTIMATORS}
    names = list(advantages)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert (advantages[a] - advantages[b]).abs().max() > 1e-3, (a, b)

"""grpo.py's step phases against an independent computation, at 1 and 2 ranks.

tests/loop_worker.py runs grpo.group_advantages, grpo.update_actor (fsdp_train.train_step with
grpo.grpo_loss_fn) and grpo.batch_metrics on a known batch under torchrun. Here the same quantities are
written out from veRL's formulas in plain PyTorch (one process, the whole batch, no losses.py), with
the recipe's regularisers on (entropy_coeff 0.003, low_var_kl 0.001), temperature 0.7, clip 0.2 / 0.28
and the dual clip firing.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import run_torchrun
from loop_worker import EMPTY_ROW, REWARDS, ROLLOUT_LOGPROB, empty_response, global_batch

TEMPERATURE, CLIP_LOW, CLIP_HIGH, CLIP_C, ENTROPY_COEFF, KL_COEF = 0.7, 0.2, 0.28, 3.0, 0.003, 0.001
MAX_PROMPT, MAX_RESPONSE = 8, 12
# Worked by hand: (r - mean) / std with the unbiased std, per group of 4 (the + 1e-6 is below the tolerance).
#   [1,0,0,0]: mean 1/4, std 1/2;  [1,1,0,0]: mean 1/2, std 1/sqrt(3);  [0,0,0,0]: 0;  [1,1,1,0]: mean 3/4, std 1/2
S3 = math.sqrt(3) / 2
ADVANTAGES = [1.5, -0.5, -0.5, -0.5, S3, S3, -S3, -S3, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, -1.5]


def reference(path: str, on_policy: bool, seq_mean_empty: bool = False) -> tuple[dict, dict]:
    """(metrics, gradients) of one update on the whole batch, from the formulas. seq_mean_empty: row
    EMPTY_ROW has no response tokens and the loss terms are seq-mean-token-mean over ALL 16 rows."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    b = global_batch(model.config.vocab_size)
    if seq_mean_empty:
        b = empty_response(b, EMPTY_ROW)
    r = b["response_mask"].shape[1]
    position_ids = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=position_ids).logits
    z = logits[:, -r - 1:-1].float() / TEMPERATURE  # [B, R, V]: position t predicts token t + 1
    logp = torch.log_softmax(z, -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]  # [B, R]
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)  # [B, R]
    mask = b["response_mask"]

    def token_mean(x):
        return (x * mask).sum() / mask.sum()

    def loss_mean(x):  # actor.loss_agg_mode
        if not seq_mean_empty:
            return token_mean(x)
        return ((x * mask).sum(-1) / (mask.sum(-1) + 1e-8)).sum() / 16  # veRL: / all rows, the empty one too

    adv = torch.tensor(ADVANTAGES)[:, None] * mask  # [B, R]
    old = logp.detach() if on_policy else b["old_logprobs"]
    log_ratio = (logp - old).clamp(-20, 20)
    ratio = log_ratio.exp()
    loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
    clipped, loss3 = torch.maximum(loss1, loss2), -adv * CLIP_C
    pg = torch.where(adv < 0, torch.minimum(loss3, clipped), clipped)
    k = (b["ref_logprobs"] - logp).clamp(-20, 20)
    kl = (k.exp() - k - 1).clamp(-10, 10)
    loss = loss_mean(pg) - ENTROPY_COEFF * loss_mean(entropy) + KL_COEF * loss_mean(kl)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    metrics = {"actor/pg_loss": loss_mean(pg), "actor/kl_loss": loss_mean(kl), "actor/ppo_kl": token_mean(-log_ratio),
               "actor/pg_clipfrac": token_mean((loss2 > loss1).float()),
               "actor/pg_clipfrac_lower": token_mean(((clipped > loss3) & (adv < 0)).float()),
               "actor/grad_norm": torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))}
    if on_policy:  # what the skipped old-log-prob pass would have logged
        diff = (logp - ROLLOUT_LOGPROB).abs() * mask
        metrics.update({"actor/entropy": token_mean(entropy), "rollout/logprob_diff_max": diff.max(),
                        "rollout/logprob_diff_mean": diff.sum() / mask.sum()})
    return {k: float(v.detach()) for k, v in metrics.items()}, grads


def expected_batch_metrics() -> dict:
    b = global_batch(100)
    resp = b["response_mask"].sum(-1).tolist()
    prompt = b["attention_mask"].sum(-1).sub(b["response_mask"].sum(-1)).tolist()
    adv_tokens = [a for a, n in zip(ADVANTAGES, resp) for _ in range(int(n))]
    out = {}
    for key, values in (("critic/score", REWARDS), ("critic/rewards", REWARDS), ("critic/advantages", adv_tokens),
                        ("critic/returns", adv_tokens), ("response_length", resp), ("prompt_length", prompt)):
        out.update({f"{key}/mean": sum(values) / len(values), f"{key}/max": max(values), f"{key}/min": min(values)})
    out["response_length/clip_ratio"] = sum(n >= MAX_RESPONSE for n in resp) / len(resp)
    out["prompt_length/clip_ratio"] = sum(n >= MAX_PROMPT for n in prompt) / len(prompt)
    total = sum(resp) + sum(prompt)
    out.update({"perf/total_num_tokens": total, "timing_per_token_ms/gen": 2.0 * 1000 / sum(resp),
                "timing_per_token_ms/update_actor": 3.0 * 1000 / total})
    return out


@pytest.fixture(scope="module")
def runs(random_models, tmp_path_factory):
    """{world: (per-rank reports, out dir)} for 1 and 2 ranks."""
    out = {}
    for world in (1, 2):
        folder = tmp_path_factory.mktemp(f"loop{world}")
        out[world] = (run_torchrun("loop_worker.py", world, random_models["tied"], str(folder)), folder)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_advantages_are_group_normalised_rewards(runs, world):
    reports, _ = runs[world]
    b = global_batch(100)
    for rep in reports:
        for row, adv in zip(rep["rows"], rep["advantages"]):
            length = int(b["response_mask"][row].sum())
            assert adv[:length] == pytest.approx([ADVANTAGES[row]] * length, abs=1e-5)  # broadcast over tokens
            assert all(a == 0.0 for a in adv[length:])  # and masked beyond
    assert sorted(row for rep in reports for row in rep["rows"]) == list(range(16))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["off_policy", "on_policy", "seq_mean_empty"])
def test_update_matches_the_formulas(runs, random_models, world, mode):
    reports, folder = runs[world]
    expected, grads = reference(random_models["tied"], on_policy=mode == "on_policy",
                                seq_mean_empty=mode == "seq_mean_empty")
    if mode == "off_policy":  # the batch really exercises every branch of the loss
        assert expected["actor/pg_clipfrac"] > 0.1 and expected["actor/pg_clipfrac_lower"] > 0.05
    for rep in reports:
        for key, value in expected.items():
            assert rep[mode][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert rep[mode]["actor/kl_coef"] == KL_COEF
    weights = torch.load(folder / f"{mode}_ws{world}.pt")
    scale = max(g.abs().max().item() for g in grads.values())
    assert scale > 1e-3  # the gradient is not trivially zero
    for name, grad in grads.items():  # SGD with lr 1: before - after = the gradient
        step = weights["before"][name] - weights["after"][name]
        assert (step - grad).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("world", [1, 2])
def test_batch_metrics_are_global_values(runs, world):
    expected = expected_batch_metrics()
    for rep in runs[world][0]:
        for key, value in expected.items():
            assert rep["batch_metrics"][key] == pytest.approx(value, rel=1e-5), key  # the advantages' + 1e-6


@pytest.mark.parametrize("world", [1, 2])
def test_lr_schedule_and_logged_lr_follow_verl(runs, world):
    """veRL 0.9.1: warmup factor = step / W, so the FIRST update runs at lr 0 and changes nothing;
    actor/lr is read after the schedule steps (the next update's lr). Worked by hand for lr 0.01:
    constant, W = 2:                                      updates at 0, 0.5, 1, 1;  logged 0.5, 1, 1, 1
    cosine, W = int(0.5 * 4 steps) = 2, min_lr_ratio 0.1: updates at 0, 0.5, 1, 0.55; logged 0.5, 1, 0.55, 0.1
    (cosine factor at step s >= W: 0.1 + 0.9 * (1 + cos(pi * (s - 2) / 2)) / 2)."""
    for rep in runs[world][0]:
        assert rep["constant"]["lr"] == pytest.approx([0.005, 0.01, 0.01, 0.01])
        assert rep["cosine"]["lr"] == pytest.approx([0.005, 0.01, 0.0055, 0.001])
        for name in ("constant", "cosine"):
            assert rep[name]["unchanged"] == [True, False, False, False]

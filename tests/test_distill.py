"""On-policy distillation (distill.py) against veRL 0.9.1's own functions, written out line for line in
tests/helpers/verl_distillation.py (verl/trainer/distillation/losses.py, its fsdp/losses.py, core_algos.py and
workers/utils/losses.py), and against values computed by hand on a 3-token vocabulary.

- The update's loss, as grpo.update_actor builds it (grpo.choose_parts' loss part around grpo_loss_fn and the policy
  term; forward_kl_topk's student values as the update's forward hands them to the loss: distill.student_topk of the
  logits, at the response mask's positions): for every loss mode, both ways of use (supervised, policy gradient),
  with and without the task's loss, the clamps, the rollout correction's IS weights and two aggregations, its value
  and its gradient with respect to the student's logits equal veRL's distillation_ppo_loss to fp32 noise; its metrics
  equal veRL's metrics of the same micro-batches, reduced as train_step and the update part reduce them.
- forward_kl_topk's update where the loop runs it (tests/helpers/distill_worker.py, 2 ranks, FSDP2): the update part
  around grpo.update_actor, the student's top-k from the policy's own forward (distill.tap), several micro-batches,
  2 mini-batches, 2 PPO epochs, chunked (3 positions) and not (0): the loss, its metrics and the gradient's norm are
  veRL's on a plain transformers forward to fp32 noise, every forward's values consumed by its micro-batch's loss.
- Refused in one line: no teacher path, forward_kl_topk without topk, k1 as a supervised loss, several teachers (in
  grpo.main, before anything loads); a teacher path that does not exist, a teacher with another tokenizer (in
  grpo.main, when the policy is about to load: the model record's load); a topk above the vocabulary; a batch
  without the teacher's log-probs (a replay of a dump made without distillation).
- The teacher's pass (the advantages part, with fsdp_train.compute_logprobs and the teacher's decoder tapped) at
  rollout.temperature 0.7, in several micro-batches: a plain transformers forward's log-probs at temperature 1, the
  sampled tokens' and the top-k's.
- Two 2-rank fp32 runs (one module fixture, step 1 dumped), with the teacher = the student's own checkpoint at
  temperature 1: actor/distillation/loss is 0 to fp32 noise (k3, and forward_kl_topk), and the teacher's log-probs
  (the sampled tokens', and the top-k's log-probs and ids) are a plain transformers forward's of the teacher. The
  feature runs there with others: k3 as the advantage of a LoRA student with GSPO's task loss; forward_kl_topk on
  multi-turn samples.
"""

import functools
import inspect
import math
import os
import types

import pytest
import torch

import config
import distill
import fp32_noise
import fsdp_train as ft
import grpo
import verl_distillation as verl
from conftest import ROOT, cli_calls, run_torchrun
from grpo_runs import error_line_of_call, read_metrics, run_grpo

B, T, V, K = 4, 6, 11, 3  # rows, response positions, vocabulary, the teacher's top-k
NUM_TOKENS, NUM_SEQS = 41.0, 9.0  # the mini-batch's global counts (this micro-batch is one part of it)
TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH, KL_COEF, ENTROPY_COEFF, DISTILL_COEF = 0.2, 0.28, 0.05, 0.01, 0.7
DISTILL_CLIP_LOW, DISTILL_CLIP_HIGH = 0.15, 0.25  # distillation_loss's own clip ratios, not the actor's
CLAMPS = {"none": (None, None), "clamped": (0.6, -2.5)}  # loss_max_clamp, log_prob_min_clamp: both bite below
TEACHER = "distillation.teacher_models.teacher_model.model_path"


def micro_batch(dtype) -> dict:
    """4 rows of 6 positions: lengths 6, 3, 0 (empty) and 5 with a hole; the student's logits [B, T, V] (-2..2 and a
    few large ones, so that log-probs fall below the clamp), the teacher's (its top-3 ids per position, distinct),
    old log-probs 0.05 to 1 nat away (every clip of the policy gradient binds somewhere), advantages, IS weights."""
    g = torch.Generator().manual_seed(7)
    f64 = torch.float64
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [0] * 6, [1, 1, 0, 1, 1, 0]], dtype=dtype)
    logits = (torch.rand(B, T, V, generator=g, dtype=f64) - 0.5) * 4
    logits[..., 0] += 3.0  # a likely token: the student's and teacher's top-k overlap there
    teacher_logits = (torch.rand(B, T, V, generator=g, dtype=f64) - 0.5) * 5
    teacher_logits[..., 0] += 2.0
    teacher_all = torch.log_softmax(teacher_logits, -1)
    teacher_topk, teacher_ids = torch.topk(teacher_all, K, dim=-1)  # [B, T, K]
    responses = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, responses[..., None])[..., 0]
    return {
        "logits": logits.to(dtype),
        "responses": responses,
        "teacher_token": teacher_all.gather(-1, responses[..., None])[..., 0].to(dtype) * mask,
        "teacher_topk": teacher_topk.to(dtype),
        "teacher_ids": teacher_ids,
        "old": (logp + (torch.rand(B, T, generator=g, dtype=f64) - 0.5) * 2).to(dtype) * mask,
        "ref": (logp + torch.rand(B, T, generator=g, dtype=f64) - 0.5).to(dtype) * mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=dtype)[:, None] * mask,
        "is_weights": (torch.rand(B, T, generator=g, dtype=f64) + 0.5).to(dtype) * mask,
        "response_mask": mask,
    }


def settings(mode: str, use_pg: bool, task: bool, clamps: str) -> dict:
    """distillation.distillation_loss's keys of one case."""
    loss_max, log_prob_min = CLAMPS[clamps]
    return {
        "loss_mode": mode,
        "topk": K,
        "use_task_rewards": task,
        "distillation_loss_coef": DISTILL_COEF,
        "loss_max_clamp": loss_max,
        "log_prob_min_clamp": log_prob_min,
        "use_policy_gradient": use_pg,
        "clip_ratio": 0.2,
        "clip_ratio_low": DISTILL_CLIP_LOW,
        "clip_ratio_high": DISTILL_CLIP_HIGH,
    }


def student(b: dict, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's log-probs of the sampled tokens and entropy [B, T] from its logits, at the temperature."""
    scaled = logits / TEMPERATURE
    logp = torch.log_softmax(scaled, -1).gather(-1, b["responses"][..., None])[..., 0]
    probs = torch.softmax(scaled, -1)
    return logp, torch.logsumexp(scaled, -1) - (probs * scaled).sum(-1)


def verl_loss(s: dict, agg: str, weighted: bool, dtype, counts=(NUM_TOKENS, NUM_SEQS), rows=slice(None)) -> dict:
    """veRL's distillation_ppo_loss of the micro-batch's `rows` (the helper's literal functions): its value, its
    gradient with respect to the student's logits, and its metrics."""
    b = {key: value[rows] for key, value in micro_batch(dtype).items()}
    n = b["logits"].shape[0] * T
    logits = b["logits"].clone().requires_grad_(True)
    logp, entropy = student(b, logits)
    actor = verl.Config(
        loss_agg_mode=agg,
        global_batch_info={},
        loss_scale_factor=None,
        policy_loss={"loss_mode": "vanilla"},
        clip_ratio=0.2,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=3.0,
        entropy_coeff=ENTROPY_COEFF,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=KL_COEF,
    )
    loss_config = verl.Config(**s, policy_loss_mode="vanilla", global_batch_info={})
    distillation = verl.Config(distillation_loss=loss_config)
    data = {
        "response_mask": b["response_mask"],
        "old_log_probs": b["old"],
        "advantages": b["advantages"],
        "ref_log_prob": b["ref"],
        "dp_size": 1,
        "batch_num_tokens": counts[0],
        "global_batch_size": counts[1],
    }
    if weighted:
        data["rollout_is_weights"] = b["is_weights"]
    output = {"log_probs": logp, "entropy": entropy}
    if s["loss_mode"] == distill.TOPK:
        data["teacher_logprobs"], data["teacher_ids"] = b["teacher_topk"], b["teacher_ids"]
        topk = verl.fsdp_compute_forward_kl_topk(
            (logits / TEMPERATURE).reshape(1, n, V),
            b["teacher_topk"].reshape(1, n, K),
            b["teacher_ids"].reshape(1, n, K),
            distillation,
        )
        output.update({key: value.reshape(-1, T) for key, value in topk.items()})
    else:
        data["teacher_logprobs"] = b["teacher_token"]
    loss, metrics = verl.distillation_ppo_loss(actor, distillation, output, data)
    (grad,) = torch.autograd.grad(loss, logits)
    return {"loss": loss.detach(), "grad": grad, "metrics": {k: verl.metric_value(v) for k, v in metrics.items()}}


def students_topk(parts) -> list:
    """Where the loss part takes forward_kl_topk's student values from: the list the update's forward appends to
    (distill.parts' `student`, shared by the loss and update parts)."""
    return inspect.getclosurevars(parts.loss).nonlocals["student"]


def as_the_forward_hands_them(parts, mb: dict, logits: torch.Tensor) -> None:
    """What the update's forward hands the loss (distill.tap: the policy's decoder, at the positions of the response
    mask's tokens, row by row): distill.student_topk of the raw logits [b, T, V] there, against the teacher's ids."""
    on = mb["response_mask"] > 0
    students_topk(parts).append(distill.student_topk(logits[on], mb["teacher_ids"][on], TEMPERATURE))


def flatgrpo_loss(s: dict, agg: str, weighted: bool, counts=(NUM_TOKENS, NUM_SEQS), rows=slice(None)) -> dict:
    """The update's loss as grpo.update_actor builds it from grpo.choose_parts (fp32), on the micro-batch's `rows`:
    forward_kl_topk's student values as the update's forward hands them over."""
    overrides = [
        "distillation.enabled=true",
        f"{TEACHER}=teacher",
        f"rollout.temperature={TEMPERATURE}",
        f"actor.loss_agg_mode={agg}",
        f"actor.clip_ratio_low={CLIP_LOW}",
        f"actor.clip_ratio_high={CLIP_HIGH}",
        f"actor.entropy_coeff={ENTROPY_COEFF}",
        f"actor.kl_loss_coef={KL_COEF}",
        "actor.kl_loss_type=low_var_kl",
        "data.max_response_length=16",
    ]
    overrides += [f"distillation.distillation_loss.{key}={'null' if v is None else v}" for key, v in s.items()]
    cfg = config.load_config(None, overrides)
    parts = grpo.choose_parts(cfg)
    b = {key: value[rows] for key, value in micro_batch(torch.float32).items()}
    logits = b["logits"].clone().requires_grad_(True)
    logp, entropy = student(b, logits)
    mb = {"old_logprobs": b["old"], "ref_logprobs": b["ref"], "advantages": b["advantages"]}
    mb["response_mask"] = b["response_mask"]
    if weighted:
        mb["is_weights"] = b["is_weights"]
    if s["loss_mode"] == distill.TOPK:
        mb["teacher_logprobs"], mb["teacher_ids"] = b["teacher_topk"], b["teacher_ids"]
        as_the_forward_hands_them(parts, mb, logits)
    else:
        mb["teacher_logprobs"] = b["teacher_token"]
    loss_fn = parts.loss(cfg, parts.policy_term)
    loss, metrics = loss_fn(logp, entropy, mb, {"num_tokens": counts[0], "num_seqs": counts[1]})
    assert not students_topk(parts)  # taken by the loss of the micro-batch whose forward made them
    (grad,) = torch.autograd.grad(loss, logits)
    return {"loss": loss.detach(), "grad": grad, "metrics": metrics}


def without_metrics(out: dict) -> dict:
    return {key: value for key, value in out.items() if key != "metrics"}


MODES = (*distill.ESTIMATORS, distill.TOPK)
CASES = [
    (mode, use_pg, task)
    for mode in MODES
    for use_pg in (False, True)
    for task in (True, False)
    if use_pg or mode not in ("k1", "kl")  # refused: test_bad_settings_are_refused_in_one_line
]


@pytest.mark.parametrize(
    "clamps,weighted,agg", [("none", False, "seq-mean-token-mean"), ("clamped", True, "token-mean")]
)
@pytest.mark.parametrize("mode,use_pg,task", CASES)
def test_the_update_loss_equals_verls_distillation_loss(mode, use_pg, task, clamps, weighted, agg):
    s = settings(mode, use_pg, task, clamps)
    ref, noise = fp32_noise.measure(lambda dtype: without_metrics(verl_loss(s, agg, weighted, dtype)))
    got = flatgrpo_loss(s, agg, weighted)
    for key in ("loss", "grad"):
        fp32_noise.check(got[key], ref[key], noise[key], f"{mode} pg={use_pg} task={task} {clamps} {agg} {key}")


@pytest.mark.parametrize("mode,use_pg,task", [c for c in CASES if c[2] or c[1]] + [("k3", False, False)])
def test_the_metrics_are_verls(mode, use_pg, task):
    """A mini-batch of two micro-batches (rows 0-1 and 2-3, each with the mini-batch's counts), flatgrpo's metrics
    reduced as train_step reduces them (summed; "_max" keys by the maximum), then named as the update part names them
    (distill.finish_names: the minima the loss reported negated as maxima): each actor/distillation/* metric is
    veRL's distillation/* (which its trainer prefixes with actor/) of the two micro-batches, combined as veRL's
    aggregation does for sums, minima and maxima, and for means weighted by the micro-batches' token counts (veRL:
    unweighted; docs/verl-mapping.md section 8); no other distillation metric."""
    s = settings(mode, use_pg, task, "clamped")
    mask = micro_batch(torch.float64)["response_mask"]
    counts = (float(mask.sum()), float(B))
    got, ref = {}, {}
    for rows in (slice(0, 2), slice(2, 4)):
        ft._accumulate(got, flatgrpo_loss(s, "token-mean", True, counts, rows)["metrics"])
        share = float(mask[rows].sum()) / counts[0]
        for key, value in verl_loss(s, "token-mean", True, torch.float64, counts, rows)["metrics"].items():
            if key.endswith("_min"):
                ref[key] = min(ref.get(key, math.inf), value)
            elif key.endswith("_max"):
                ref[key] = max(ref.get(key, -math.inf), value)
            else:
                ref[key] = ref.get(key, 0.0) + (value if key == "distillation/loss" else share * value)
    got = distill.finish_names(got)
    expected = {f"actor/{k}": v for k, v in ref.items() if k.startswith("distillation/")}
    assert {k for k in got if "distillation" in k} == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if task or use_pg:  # the task's own loss is computed and logged (veRL: even when use_task_rewards drops it)
        assert "actor/pg_loss" in got and "actor/kl_loss" in got
    else:
        assert "actor/pg_loss" not in got


def test_the_paths_are_told_apart():
    """The cases above could not pass with a clamp ignored, the IS weights dropped, the task's loss kept without
    use_task_rewards or the coefficient applied to it: in float64 those change the value or gradient far beyond
    fp32 noise."""
    f64 = torch.float64
    for mode in ("k3", distill.TOPK):
        plain = verl_loss(settings(mode, True, True, "none"), "token-mean", True, f64)
        clamped = verl_loss(settings(mode, True, True, "clamped"), "token-mean", True, f64)
        unweighted = verl_loss(settings(mode, True, True, "clamped"), "token-mean", False, f64)
        without_task = verl_loss(settings(mode, True, False, "clamped"), "token-mean", True, f64)
        for other in (clamped, unweighted, without_task):
            assert (plain["grad"] - other["grad"]).abs().max() > 1e-3 or abs(plain["loss"] - other["loss"]) > 1e-3


# ------------------------------------------------------------------------------- hand-computed values
def test_a_3_token_vocabulary_by_hand():
    """q = softmax(student logits) = [0.5, 0.3, 0.2]; the teacher's top-2 ids [0, 2], p = [0.6, 0.3]; the sampled
    token 0. By hand: forward KL over the top-2 = 0.6 ln(0.6/0.5) + 0.3 ln(0.3/0.2); its gradient in the logits
    (p_0 + p_2) q - p = [-0.15, 0.27, -0.12]; the student's top-2 is {0, 1}: one overlap (id 0), overlap_token_advantage
    -0.6 ln(1.2); masses 0.7 and 0.9; k3 of the sampled token exp(t - s) - (t - s) - 1 with t - s = ln(0.6/0.5).
    Through the update's loss (one token, token-mean, supervised, no task): the same value and gradient."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)).requires_grad_(True)
    ids, teacher = torch.tensor([[0, 2]]), torch.log(torch.tensor([[0.6, 0.3]], dtype=torch.float64))
    values = distill.topk_token_values(*distill.student_topk(logits, ids, 1.0), teacher)
    kl = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.2)
    assert values["loss"].item() == pytest.approx(kl, rel=1e-6) and kl == pytest.approx(0.231033, abs=1e-6)
    (grad,) = torch.autograd.grad(values["loss"].sum(), logits)
    assert grad[0].tolist() == pytest.approx([-0.15, 0.27, -0.12], abs=1e-6)  # in fp32, as veRL's kl_divergence
    assert values["student_mass"].item() == pytest.approx(0.7) and values["teacher_mass"].item() == pytest.approx(0.9)
    assert values["overlap_count"].item() == 1
    assert values["overlap_token_advantage"].item() == pytest.approx(-0.6 * math.log(1.2), rel=1e-6)
    d = math.log(0.6 / 0.5)
    k3 = distill.estimator_losses(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.6)]), "k3")
    assert k3.item() == pytest.approx(math.exp(d) - d - 1, rel=1e-5)
    # the same position through the update's loss: mask [[1]], 1 token, logits at temperature 1
    cfg = config.load_config(
        None,
        [
            "distillation.enabled=true",
            f"{TEACHER}=teacher",
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=2",
            "distillation.distillation_loss.use_task_rewards=false",
        ],
    )
    parts = grpo.choose_parts(cfg)
    z = logits.detach().float().clone().requires_grad_(True)
    mb = {"response_mask": torch.ones(1, 1), "teacher_logprobs": teacher.float()[None], "teacher_ids": ids[None]}
    students_topk(parts).append(distill.student_topk(z, ids, 1.0))
    logp = torch.log_softmax(z, -1)[:, :1]
    loss, metrics = parts.loss(cfg, parts.policy_term)(logp, None, mb, {"num_tokens": 1.0, "num_seqs": 1.0})
    (grad,) = torch.autograd.grad(loss, z)
    assert loss.item() == pytest.approx(kl, rel=1e-6) and metrics["actor/distillation/loss"] == pytest.approx(kl)
    assert grad[0].tolist() == pytest.approx([-0.15, 0.27, -0.12], abs=1e-6)
    assert metrics["actor/distillation/overlap_ratio"] == pytest.approx(0.5)


# ------------------------------------------------------------------------------- the teacher's pass
def loaded(loads: list, model, path: str, device):
    """A teacher's load (grpo.frozen_model's signature) that hands back `model` and records each call in loads."""
    loads.append((path, device))
    return model


def test_the_teacher_pass_is_at_temperature_1_whatever_the_rollouts(random_models):
    """The advantages part's teacher pass (distill.teacher_part, the teacher given) at rollout.temperature 0.7, in
    micro-batches of at most 8 tokens and chunks of 2 positions: the teacher's log-probs of the sampled tokens, and
    its top-k log-probs and ids (through its decoder's tap), are a plain transformers forward's at temperature 1
    (veRL's teacher always uses 1.0) to fp32 noise, 0 outside the response mask; then the task's advantages come as
    before; the teacher is loaded once, at the first call."""
    from transformers import AutoModelForCausalLM

    ft.init_distributed()
    model = AutoModelForCausalLM.from_pretrained(random_models["untied"], dtype=torch.float32)
    models = {torch.float32: model, torch.float64: fp32_noise.float64_copy(model)}
    batch = ft.make_batch([[5, 6, 7], [8], [9, 10, 4]], [[11, 12], [13, 14, 15], [16]], pad_id=0)
    batch["response_mask"][1, 1] = 0  # a hole
    mask, width = batch["response_mask"], 3

    def compute(dtype):
        attention = batch["attention_mask"]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = models[dtype](input_ids=batch["input_ids"], attention_mask=attention, position_ids=positions)
        logp = torch.log_softmax(out.logits[:, -width - 1 : -1], -1)  # [3, 3, V] at temperature 1
        values, ids = torch.topk(logp, 4, dim=-1)
        token = logp.gather(-1, batch["input_ids"][:, -width:, None])[..., 0] * mask
        return {"token": token, "topk": values * mask[..., None], "ids": ids}

    ref, noise = fp32_noise.measure(compute)
    run = types.SimpleNamespace(policy=model)
    for mode in ("k3", distill.TOPK):
        cfg = config.load_config(
            None,
            [
                "rollout.temperature=0.7",
                "actor.ppo_max_token_len_per_gpu=8",
                "actor.logprob_chunk_size=2",
                "distillation.enabled=true",
                f"{TEACHER}=teacher",
                f"distillation.distillation_loss.loss_mode={mode}",
                "distillation.distillation_loss.topk=4",
            ],
        )
        loads = []
        load = functools.partial(loaded, loads, model)
        part = distill.teacher_part(cfg, lambda run, batch: {"advantages": "computed"}, lambda path: path, load)
        for _ in range(2):
            b = dict(batch)
            out = part(run, b)
            assert out["advantages"] == "computed" and out["timing_s/teacher"] > 0
        assert loads == [("teacher", torch.device("cpu"))]
        if mode == "k3":
            fp32_noise.check(b["teacher_logprobs"], ref["token"], noise["token"], "teacher_logprobs")
            assert "teacher_ids" not in b
        else:
            on = mask.bool()
            fp32_noise.check(b["teacher_logprobs"], ref["topk"], noise["topk"], "teacher top-k")
            assert b["teacher_ids"][on].equal(ref["ids"][on]) and (b["teacher_ids"][~on] == 0).all()
            assert distill.PLACES not in b and distill.PLACES not in b.get("layouts", {})


def test_a_teacher_of_a_family_with_a_logit_rule_is_loaded_with_it(tiny_tokenizer, tmp_path):
    """grpo.frozen_model, the teacher's load: a Gemma 2 teacher (final_logit_softcapping 30) gets its family's rule
    (logit_rules, as the policy's model record would), so the start-up proof (check_logits_fn) passes and the
    log-prob path's logits are its forward's; loaded frozen."""
    import transformers

    import tiny

    _, _, device = ft.init_distributed()
    path = tiny.save_random_family_model(
        str(tmp_path / "gemma2"), tiny_tokenizer, transformers.Gemma2Config, seed=2, final_logit_softcapping=30.0
    )
    cfg = config.load_config("tiny.yaml", [])
    teacher = grpo.frozen_model(cfg, path, device)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        own, ours = teacher(input_ids=ids).logits, teacher.trainer_logits(ids)
    assert torch.equal(own, ours)


# ------------------------------------------------------------------------------- the update, in the loop
@pytest.fixture(scope="module")
def update_in_the_loop(random_models):
    """tests/helpers/distill_worker.py at 2 ranks, chunk sizes 0 and 3: [rank 0's report, rank 1's]."""
    return run_torchrun("distill_worker.py", 2, random_models["untied"], "--chunks", "0", "3")


@pytest.mark.parametrize("chunk", ["0", "3"])
def test_forward_kl_topks_update_in_the_loop_is_verls(update_in_the_loop, chunk):
    """The update part (distill's around grpo.update_actor) on 2 ranks, FSDP2, 2 mini-batches x 2 PPO epochs cut into
    micro-batches of at most 16 tokens (at least 2 each), the student's top-k from the policy's own forward (chunked
    by 3 positions, or in one piece): actor/distillation/loss, its range, the masses, overlap_ratio and
    actor/grad_norm (the gradient of the whole update through the hooked forward) are veRL's loss on a plain
    transformers forward of each global mini-batch, to fp32 noise; both ranks log the same; every forward's values
    were taken by its own loss; the batch no longer carries the teacher's ids laid out for the forwards."""
    rank0, rank1 = update_in_the_loop
    ref, noise = rank0["reference"], rank0["noise"]
    for report in (rank0, rank1):
        got = report[chunk]
        assert got["left"] == 0 and min(got["micro_batches"]) >= 2 and not got["field_kept"]
        for key in [key for key in ref if key != "grad_norm"]:
            fp32_noise.check(got["metrics"][f"actor/distillation/{key}"], ref[key], noise[key], f"chunk {chunk} {key}")
        fp32_noise.check(got["metrics"]["actor/grad_norm"], ref["grad_norm"], noise["grad_norm"], f"chunk {chunk}")
    assert ref["loss"] > 0.1 and ref["loss_min"] < ref["loss_max"]  # a real loss, spread over the tokens


# ------------------------------------------------------------------------------- refusals
def test_bad_settings_are_refused_in_one_line(tmp_path, random_models, tiny_build):
    """Each stops in grpo.main in one line that names the key: the settings before anything loads (choose_parts
    checks the feature's settings); a teacher path that is not a model, or whose tokenizer is not the student's, when
    the policy is about to load (the model record's load: distill.checked_loader)."""
    base = ["--config", "tiny.yaml", "distillation.enabled=true", f"trainer.output_dir={tmp_path}"]
    calls = {
        "no teacher": base,
        "no topk": [*base, f"{TEACHER}=tiny", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                    "distillation.distillation_loss.topk=null"],
        "k1": [*base, f"{TEACHER}=tiny", "distillation.distillation_loss.loss_mode=k1"],
        "two teachers": [*base, f"{TEACHER}=tiny", "distillation.teacher_models.teacher_model2.model_path=tiny"],
        "no such teacher": [*base, f"{TEACHER}=/no/such/teacher"],
        "other tokenizer": [*base, f"{TEACHER}={random_models['tied']}"],
    }  # fmt: skip
    from transformers import AutoTokenizer

    lines = {name: error_line_of_call(result) for name, result in cli_calls(calls, tmp_path).items()}
    assert lines["no teacher"].endswith(f"needs {TEACHER} (the teacher: a local directory, a hub id, or tiny_teacher), "
                                        "got null")  # fmt: skip
    assert "loss_mode = forward_kl_topk needs distillation.distillation_loss.topk" in lines["no topk"]
    assert "loss_mode = k1 with distillation.distillation_loss.use_policy_gradient=false" in lines["k1"]
    assert "unknown key 'distillation.teacher_models.teacher_model2.model_path'" in lines["two teachers"]
    assert lines["no such teacher"].startswith(f"error: config: {TEACHER} = '/no/such/teacher': no such directory")
    other, student = lines["other tokenizer"], len(AutoTokenizer.from_pretrained(tiny_build["model"]))
    assert other.startswith(f"error: config: {TEACHER} = '{random_models['tied']}': the teacher's tokenizer (")
    assert f"tokens, {random_models['tied']}) is not the student's ({student} tokens, " in other


def test_a_topk_above_the_vocabulary_is_refused_and_a_teacher_of_the_same_tokenizer_accepted(tiny_build):
    """The model record's load (grpo.choose_model_parts with distillation on), as grpo.load_models calls it: the
    teacher checked before the policy loads; the student's own checkpoint as the teacher loads; a topk above the
    vocabulary stops in one line; a frozen load (the reference) checks nothing."""
    from transformers import AutoTokenizer

    _, _, device = ft.init_distributed()
    vocab = len(AutoTokenizer.from_pretrained(tiny_build["model"]))
    overrides = [
        "distillation.enabled=true",
        f"{TEACHER}=tiny",
        f"distillation.distillation_loss.loss_mode={distill.TOPK}",
    ]
    cfg = config.load_config("tiny.yaml", [*overrides, f"distillation.distillation_loss.topk={vocab + 1}"])
    model = grpo.choose_model_parts(cfg, tiny_build["model"])
    with pytest.raises(distill.DistillError, match=rf"topk = {vocab + 1}; accepted: at most the vocabulary") as error:
        model.load(tiny_build["model"], device=device)
    assert grpo.one_line(error.value) and len(str(error.value).splitlines()) == 1
    assert model.load(tiny_build["model"], device=device, trainable=False) is not None  # the reference: no check
    cfg = config.load_config("tiny.yaml", [*overrides, f"distillation.distillation_loss.topk={vocab}"])
    assert grpo.choose_model_parts(cfg, tiny_build["model"]).load(tiny_build["model"], device=device) is not None


def test_a_batch_without_the_teachers_logprobs_is_refused_in_one_line():
    """A replay of batches dumped without distillation brings no teacher log-probs: the update (forward_kl_topk: the
    teacher's ids it lays out for the forward) and the loss stop in one line (grpo.main prints it), not with a
    KeyError; so does a loss whose micro-batch's forward handed it no top-k values."""
    mb = {"response_mask": torch.ones(1, 1), "advantages": torch.zeros(1, 1), "ref_logprobs": torch.zeros(1, 1)}
    counts = {"num_tokens": 1, "num_seqs": 1}
    for mode in ("k3", distill.TOPK):
        mode_key = f"distillation.distillation_loss.loss_mode={mode}"
        cfg = config.load_config(None, ["distillation.enabled=true", f"{TEACHER}=teacher", mode_key])
        parts = grpo.choose_parts(cfg)
        with pytest.raises(distill.DistillError, match=r"^distillation: the batch has no teacher_logprobs") as error:
            if mode == distill.TOPK:
                parts.update(None, dict(mb), {})
            else:
                parts.loss(cfg, parts.policy_term)(torch.zeros(1, 1), None, mb, counts)
        assert grpo.one_line(error.value) and len(str(error.value).splitlines()) == 1
    mb.update(teacher_logprobs=torch.zeros(1, 1, 32), teacher_ids=torch.zeros(1, 1, 32, dtype=torch.long))
    with pytest.raises(distill.DistillError, match=r"the update's forward gave the student's top-k at none positions"):
        parts.loss(cfg, parts.policy_term)(torch.zeros(1, 1), None, mb, counts)


# ------------------------------------------------------------------------------- 2-rank runs
RUN = [
    "trainer.total_steps=1",
    "actor.ppo_mini_batch_size=8",  # one mini-batch: the update's forward is the initial student's
    "trainer.val_before_train=false",
    "trainer.val_every=0",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "rollout.temperature=1.0",
    "distillation.enabled=true",
]


@pytest.fixture(scope="module")
def tools_build():
    """tiny.build(tools=True), cached in .cache/tiny; a lock as test_multi_turn's (the other worker may build)."""
    import fcntl

    import tiny

    cache = os.path.join(ROOT, ".cache", "tiny")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock-tools"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return tiny.build(cache, seed=0, tools=True)


# Each run also combines the feature with others, where their code paths differ: k3 as the per-token advantage
# (use_policy_gradient) of a LoRA student (the reference: the policy with its adapters off) whose task loss is
# GSPO's; forward_kl_topk on multi-turn samples (tool responses inside the response, out of its mask).
COMBINED = {
    "k3": ["model.lora_rank=8", "model.lora_alpha=16", "actor.policy_loss.loss_mode=gspo",
           "distillation.distillation_loss.use_policy_gradient=true"],
    distill.TOPK: ["model.path=tiny_tools", "rollout.multi_turn.enable=true",
                   "rollout.multi_turn.max_assistant_turns=3", "data.max_response_length=96"],
}  # fmt: skip


@pytest.fixture(scope="module")
def same_teacher_runs(tiny_build, tools_build, tmp_path_factory):
    """2-rank fp32 runs whose teacher is the student's own checkpoint, at temperature 1, step 1 dumped: k3 (the
    sampled tokens) and forward_kl_topk (the top-k), each with COMBINED's features. {mode: (metrics of step 1, the
    dumped batch, and a plain transformers forward of the teacher on it: the float64 reference and the fp32
    noise, teacher_forward)}."""
    out = {}
    for mode, teacher in (("k3", tiny_build["model"]), (distill.TOPK, tools_build["model"])):
        folder = tmp_path_factory.mktemp(mode)
        run_grpo(
            folder,
            2,
            *RUN,
            f"{TEACHER}={teacher}",
            f"distillation.distillation_loss.loss_mode={mode}",
            "distillation.distillation_loss.topk=8",
            f"trainer.dump_batches={folder / 'dump'}",
            *COMBINED[mode],
        )
        batch = torch.load(folder / "dump" / "step_1.pt", weights_only=False)
        reference = fp32_noise.measure(teacher_forward(teacher, batch, 8))
        out[mode] = (read_metrics(folder)[-1], batch, *reference)
    return out


def teacher_forward(path: str, batch: dict, topk: int):
    """A plain transformers forward of the teacher on the dumped rows (padded, its own attention), as compute(dtype)
    for fp32_noise.measure: each response token's log-prob [B, R]; the top-k log-probs [B, R, k] at each response
    position, and the top-(k + 1)'s ids [B, R, k + 1] (the last to see near-ties)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    models = {torch.float32: model, torch.float64: fp32_noise.float64_copy(model)}
    width, attention = batch["response_mask"].shape[1], batch["attention_mask"]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    def compute(dtype):
        with torch.no_grad():
            out = models[dtype](input_ids=batch["input_ids"], attention_mask=attention, position_ids=positions)
        logp = torch.log_softmax(out.logits[:, -width - 1 : -1].to(dtype), -1)  # [B, R, V]
        mask = batch["response_mask"].to(dtype)
        token = logp.gather(-1, batch["input_ids"][:, -width:, None])[..., 0] * mask
        top, ids = torch.topk(logp, topk + 1, dim=-1)
        return {"token": token, "topk": top[..., :topk] * mask[..., None], "next": top[..., topk:], "ids": ids}

    return compute


@pytest.mark.parametrize("mode", ["k3", distill.TOPK])
def test_a_teacher_equal_to_the_student_gives_zero_loss_at_step_1(same_teacher_runs, mode):
    """distillation/loss at step 1 is 0 to fp32 noise: the teacher's log-probs are the student's own. Bound:
    FACTOR x the fp32 noise of the teacher's log-probs (measured: a plain forward in fp32 against float64); a
    loss per token of sum_k p_k |log p_k - log q_k| is at most that."""
    metrics, _, _, noise = same_teacher_runs[mode]
    bound = fp32_noise.FACTOR * max(noise["token"], noise["topk"])
    assert abs(metrics["actor/distillation/loss"]) <= bound, (metrics["actor/distillation/loss"], bound)
    assert metrics["actor/distillation/loss_max"] <= bound and metrics["actor/distillation/loss_min"] >= -bound
    if mode == distill.TOPK:  # the masses are the same, the top-k ids too
        assert metrics["actor/distillation/student_mass"] == pytest.approx(metrics["actor/distillation/teacher_mass"])
        assert metrics["actor/distillation/overlap_ratio"] == pytest.approx(1.0, abs=0.01)
    else:
        assert metrics["actor/distillation/abs_loss"] <= bound


@pytest.mark.parametrize("mode", ["k3", distill.TOPK])
def test_the_teachers_logprobs_are_a_plain_transformers_forward(same_teacher_runs, mode):
    """The dumped teacher log-probs (k3: each sampled token's [B, R]; forward_kl_topk: the top-k's [B, R, k] and
    their ids) against a plain transformers forward of the teacher on the same rows: within FACTOR x fp32 noise;
    the ids equal wherever the k-th and (k+1)-th log-probs are apart by more than the noise."""
    _, batch, ref, noise = same_teacher_runs[mode]
    mask = batch["response_mask"].bool()
    if mode == "k3":
        fp32_noise.check(batch["teacher_logprobs"], ref["token"], noise["token"], "teacher_logprobs")
        assert batch["teacher_logprobs"][mask].min() < -1e-3  # real log-probs, not zeros
        return
    fp32_noise.check(batch["teacher_logprobs"], ref["topk"], noise["topk"], "teacher top-k logprobs")
    top = torch.cat([ref["topk"], ref["next"]], -1)  # [B, R, 9]: where no two are within 16 x the noise, the order
    apart = (top[..., :-1] - top[..., 1:]).min(-1).values > fp32_noise.FACTOR * noise["topk"]  # is certain
    assert batch["teacher_ids"].shape == (*mask.shape, 8) and batch["teacher_ids"].dtype == torch.int64
    assert (mask & apart).sum() > 0.9 * mask.sum()
    assert batch["teacher_ids"][mask & apart].equal(ref["ids"][..., :8][mask & apart])


def test_the_runs_logged_veRLs_metrics(same_teacher_runs):
    """Each run's actor/distillation/* keys are veRL's for its mode and way of use; the task's loss is logged too."""
    names = {
        "k3": ("loss", "abs_loss", "loss_min", "loss_max", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
        distill.TOPK: ("loss", "loss_min", "loss_max", "student_mass", "student_mass_min", "student_mass_max",
                       "teacher_mass", "teacher_mass_min", "teacher_mass_max", "overlap_ratio",
                       "overlap_token_advantage"),
    }  # fmt: skip
    for mode, keys in names.items():
        metrics = same_teacher_runs[mode][0]
        assert {k for k in metrics if k.startswith("actor/distillation/")} == {f"actor/distillation/{k}" for k in keys}
        assert metrics["timing_s/teacher"] > 0 and "actor/pg_loss" in metrics

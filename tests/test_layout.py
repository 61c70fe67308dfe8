"""The layout's rules, enforced: every optional feature is a file of its own that enters the loop only in grpo.py's
set-up (choose_parts and the functions that build the run) and finish, and can be deleted with its key off; the
step's parts are a typed record whose defaults are plain GRPO's.

- Statically (ast): no project module imports a feature file, but grpo.py inside its set-up and finish functions,
  and a feature file imports only the component it extends; no phase of grpo.py (every other function) names a
  feature module or a feature's key.
- The parts (ast and import): grpo.py imports no feature through importlib; Parts is a dataclass whose every field
  defaults to a GRPO function, to None (an optional hook) or to False (a flag); only main builds the parts
  (choose_parts), and only choose_parts builds a Parts.
- The components (ast): the code of sync.py, fsdp_train.py, rollout.py, losses.py and reward.py, comments and
  docstrings aside, names no feature (FEATURE_WORD): LoRA's merge, MoE's expert repacking and routing field reach
  them as arguments.
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
)
COMPONENTS = ("rollout", "reward", "losses", "fsdp_train", "sync", "tiny")
EXTENDS = {  # a feature may import what it extends
    "grpo_family": {"losses"},
    "rollout_correction": {"losses"},
    "agent": {"multi_turn"},  # the tool pool's worker design (WorkerPool) and Hermes parser: one of each in the project
}
SETUP = {  # grpo.py's set-up and finish code: where a feature's file may be imported (feature), its keys read
    "main",
    "choose_parts",
    "lora_on",
    "rollout_ranks_on",
    "rollout_ranks_run",
    "setup",
    "exact_run",
    "on_policy_shortcut",
    "load_data",
    "load_models",
    "model_head",
    "start_engine",
    "start_proven_engine",
    "engine_after_load",
    "match_engine_dtypes",
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


def test_the_parts_are_a_typed_record_of_grpos_functions_built_once():
    """grpo.py imports nothing through importlib (a feature's file is a plain import inside its guard); grpo.Parts is a
    dataclass, every field typed and defaulting to a function of plain GRPO (grpo.py's or a component's), to None
    (an optional hook, guarded where it is called) or to False (a flag a feature raises); choose_parts is called by
    main alone, Parts() by choose_parts alone: no product function falls back to building the parts."""
    import dataclasses

    import grpo

    tree = modules()["grpo"]
    assert "importlib" not in imported(tree) and "importlib" not in open(os.path.join(ROOT, "grpo.py")).read()
    assert dataclasses.is_dataclass(grpo.Parts)
    import data
    import rollout

    grpos = {  # plain GRPO's step: the functions the README's reading order names
        "pick_groups": grpo.next_groups,
        "scored_samples": grpo.sample_and_score,
        "sample": rollout.generate,
        "score": data.gsm8k_score,
        "advantages": grpo.grpo_advantages,
        "policy_term": grpo.policy_term,
    }
    fields = dataclasses.fields(grpo.Parts)
    for field in fields:
        assert field.type is not dataclasses.MISSING and field.default is not dataclasses.MISSING, field.name
        plain = grpos.get(field.name, False if field.type is bool else None)  # a hook: None; a feature's need: False
        assert field.default is plain, f"Parts.{field.name} defaults to {field.default!r}"
    assert set(grpos) <= {f.name for f in fields}
    for name, module in modules().items():
        for function in (n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            called = {
                n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                for n in ast.walk(function)
                if isinstance(n, ast.Call)
            }
            if "choose_parts" in called:
                assert (name, function.name) == ("grpo", "main"), f"{name}.{function.name} builds the parts"
            if "Parts" in called:
                assert (name, function.name) == ("grpo", "choose_parts"), f"{name}.{function.name} builds a Parts"


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

"""A learner's read of the default path: how many lines someone who follows a default run through the mission files
reads, and how many of those serve a feature that is off. A check: exits 1 above LIMIT percent.

    .venv/bin/python bench/learner_read.py                            # this tree: tiny.yaml, 2 ranks, 2 steps
    .venv/bin/python bench/learner_read.py --list                     # and every off-feature line, by function
    .venv/bin/python bench/learner_read.py --tree /tmp/before         # another checkout (a before/after count)
    .venv/bin/python bench/learner_read.py --code-only                # the earlier method: prose is never off

The method (docs/tests.md, "A learner's read"):
  run      `torchrun --nproc_per_node 2 grpo.py --config tiny.yaml trainer.total_steps=2` with each rank under
           coverage (coverage.py), the ranks' data joined, as bench/default_path.py runs it;
  read     in the mission files (grpo.py, rollout.py, reward.py, losses.py, fsdp_train.py, sync.py), the non-blank
           source lines of every function the run enters (at least one statement of its own ran; from its `def`
           to its end, docstring and comments included, a nested function counted on its own); a file's
           module-level lines (its docstring, imports, constants, the records' class bodies) are shown apart, not
           counted (--with-module counts them);
  off      of those, the lines that serve a feature that is off:
           - skipped: the statements of an entered function that the run never executes, error paths aside (raise
             statements, except clauses and their bodies): a compound statement's header, a simple one's whole span;
           - hooks: executed lines whose code names a feature or a feature's hook: an identifier or string matching
             FEATURE_WORD (lora, moe, expert, router, adapter, tool), or equal to a feature file's name or a
             subscript by a feature's key (FEATURE_FILES, FEATURE_KEYS); an optional part reached as `parts.<name>`
             (PART_HOOKS: given_old, dump, ..., and a run mode kept in a parts table: next_batch, ...); the run mode
             (`run.mode`, `mode.<phase>`, grpo.py's `mode`); an identifier in HOOKS (the plug-in points of the
             components and the set-up: transform, after_load, adapt, ...);
           - prose: docstring and comment lines that name an optional feature (PROSE_FEATURE: LoRA, experts,
             routing, multi-turn, tools, agents, episodes, the rollout correction, DAPO, the GRPO family's modes, the
             KL in the reward, dumps and replays, rollout ranks, logit rules, engine dtypes, ...) or another model
             family's need (PROSE_FAMILY: Gemma, Apertus, GPT-NeoX, sliding windows, soft-caps, state along a row,
             ...): a learner reads them too (--code-only leaves prose out, the method before issue 60).
Not read: choose_parts, in a tree whose grpo.py has the record of the step's defaults (grpo.Parts): the learner reads
the record and never opens the function that swaps a feature's part in (the README's reading order says so); in a
tree without one, the parts table was the only place the defaults were named, and is read. --with-choose-parts
counts it anyway. The share printed is off / read. The check: at most READ_LIMIT lines read and LIMIT percent off.
"""

import argparse
import ast
import io
import os
import re
import subprocess
import sys
import tempfile
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSION = ["grpo.py", "rollout.py", "reward.py", "losses.py", "fsdp_train.py", "sync.py"]
DEFAULT_RUN = ["--config", "tiny.yaml", "trainer.total_steps=2"]
LIMIT = 6.0  # percent: the most of the read that may serve a feature that is off
READ_LIMIT = 2100  # the most lines a learner reads on the default path
FEATURE_WORD = re.compile(r"lora|moe|expert|router|adapter|(?<![a-z])tool", re.IGNORECASE)
PART_HOOKS = {  # the optional parts reached as parts.<name> (None by default), the flags features raise, and a run
    "field_metrics", "needs_old_pass", "given_old", "needs_reference",  # mode's phases kept in a parts table
    "train", "start_engine", "next_batch", "update_weights", "validate", "stop_vote",
}  # fmt: skip
FEATURE_FILES = {  # a name or string equal to one of these names a feature's file (an import, feature("dapo"))
    "rollout_correction", "dapo", "grpo_family", "multi_turn", "moe", "lora", "logit_rules", "reward_files",
    "rollout_ranks", "engine_dtypes", "agent", "distill",
}  # fmt: skip
FEATURE_KEYS = {  # a subscript by one of these reads a feature's key (tests/test_layout.py's list): cfg["agent"]
    "rollout_correction", "rollout_is", "rollout_rs", "bypass_mode", "filter_groups", "overlong_buffer",
    "adv_estimator", "use_kl_in_reward", "policy_loss", "loss_mode", "kl_ctrl", "kl_penalty", "gamma", "multi_turn",
    "router_replay", "enable_rollout_routing_replay", "lora_rank", "lora_alpha", "lora_adapter_path",
    "target_modules", "exclude_modules", "custom_reward_function", "replay_batches", "dump_batches", "nnodes",
    "n_gpus_per_node", "async_training", "staleness_threshold", "agent", "distillation",
}  # fmt: skip
PROSE_FEATURE = re.compile(  # a docstring or comment line that names an optional feature
    r"lora|adapter|mixture-of-experts|\bmoe\b|expert|router|routing|\bR[23]\b|multi-turn|multi_turn|(?<![a-z])tool"
    r"|(?<!torchrun's )agent|episode|rollout.correction|IS weights|rejection|bypass|dapo|dynamic sampling"
    r"|overlong.(buffer|penalty)"
    r"|grpo.family|gspo|cispo|sapo|rloo|reinforce|geo_mean|kl in the reward|use_kl_in_reward|reward file"
    r"|custom_reward|dump|replay|rollout ranks?|staleness|async|logit rule|logit_rule|engine.dtypes|persistent buffer"
    r"|distill|teacher",
    re.IGNORECASE,
)
PROSE_FAMILY = re.compile(  # ... or another model family's need
    r"gemma|cohere|granite|apertus|xielu|neox|falcon|mamba|minicpm|mistral|phi-?3|olmo|llama|jamba|hyperclovax"
    r"|qwen3|nemotron|sliding|soft-?cap|carr(y|ies) state|state along",
    re.IGNORECASE,
)
ENTERED = []  # "<module>.<function>" of every function the run entered (count fills it; --entered prints it)
NOT_READ = {"choose_parts", "choose_model_parts"}  # with records of the defaults (grpo.Parts, grpo.ModelParts), the
# learner reads those instead
HOOKS = {  # identifiers of the components' and the set-up's plug-in points for a feature
    "transform", "after_load", "push_transform", "output_fields", "active_mlp_params", "micro_batch_hook",
    "adapt", "adapt_settings", "adapter_settings", "engine_dtypes", "logits_head", "adapter",
}  # fmt: skip


def run_rank(tree: str, data_file: str, argv: list[str]) -> None:
    """One torchrun rank: grpo.main(argv) of `tree` under coverage, the data saved before the process ends (grpo.py
    ends with os._exit, which runs no atexit hook)."""
    import coverage

    sys.path.insert(0, tree)
    cov = coverage.Coverage(data_file=data_file, data_suffix=True, include=[os.path.join(tree, f) for f in MISSION])
    cov.start()
    import grpo

    status = grpo.main(argv)
    cov.stop()
    cov.save()
    grpo.cluster.end_process(status)


def error_lines(tree: ast.Module) -> set[int]:
    """The lines of error paths: raise statements, except clauses and their bodies."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.ExceptHandler)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def functions(tree: ast.Module) -> list[tuple[str, int, int, int, set[int]]]:
    """(qualified name, first line, first line of its body past the docstring, last line, the lines nested functions
    own) of every function, decorators included."""
    found = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    nested = set()
                    for inner in ast.walk(child):
                        if inner is not child and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            start = min([inner.lineno] + [d.lineno for d in inner.decorator_list])
                            nested.update(range(start, inner.end_lineno + 1))
                    body = child.body
                    doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                    start = body[1].lineno if doc and len(body) > 1 else body[0].lineno
                    found.append((name, first, start, child.end_lineno, nested))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def statement_lines(tree: ast.Module) -> dict[int, set[int]]:
    """{a statement's first line: the lines it takes}: a compound statement's header (up to its body), a simple
    statement's whole span."""
    spans = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
            spans.setdefault(node.lineno, set()).update(range(node.lineno, max(node.lineno, end) + 1))
    return spans


def hook_lines(tree: ast.Module, grpo: bool) -> set[int]:
    """The lines whose code names a feature or a feature's hook (FEATURE_WORD, PART_HOOKS, the run mode, HOOKS),
    docstrings aside. grpo: the file is grpo.py (where the name `mode` is the run mode)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    lines = set()
    for n in ast.walk(tree):
        words, hook = [], False
        if isinstance(n, ast.Name):
            words, hook = [n.id], grpo and n.id == "mode"
        elif isinstance(n, ast.Attribute):
            owner = n.value.id if isinstance(n.value, ast.Name) else getattr(n.value, "attr", "")
            words = [n.attr]
            hook = (
                (owner == "parts" and n.attr in PART_HOOKS) or (owner == "run" and n.attr == "mode") or owner == "mode"
            )
        elif isinstance(n, ast.arg):
            words, hook = [n.arg], grpo and n.arg == "mode"
        elif isinstance(n, ast.keyword) and n.arg:
            words = [n.arg]
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            words = [n.value]
        named = any(w in HOOKS or w in FEATURE_FILES or FEATURE_WORD.search(w) for w in words)
        read_key = isinstance(n, ast.Subscript) and getattr(n.slice, "value", None) in FEATURE_KEYS
        if hook or named or read_key:
            lines.add(n.lineno)
    return lines


def prose_lines(source: str, tree: ast.Module) -> dict[int, str]:
    """{line: its prose}: every line of a docstring, and every comment (its text only)."""
    prose = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                if isinstance(first.value.value, str):
                    text = source.splitlines()
                    prose.update({k: text[k - 1] for k in range(first.lineno, first.end_lineno + 1)})
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose[token.start[0]] = prose.get(token.start[0], "") + " " + token.string
    return prose


def count(tree_root: str, data_file: str, show: bool, with_choose_parts: bool, code_only: bool, with_module: bool):
    """(lines read, lines off) over the mission files, a table printed (and each off line with --list)."""
    import coverage

    cov = coverage.Coverage(data_file=data_file)
    cov.combine()
    cov.load()
    total_read = total_off = 0
    print(f"{'file':14s} {'read':>6s} {'skipped':>8s} {'hooks':>6s} {'prose':>6s} {'off':>6s} {'module':>7s}")
    for name in MISSION:
        path = os.path.join(tree_root, name)
        source = open(path).read()
        text, tree = source.splitlines(), ast.parse(source)
        _, statements, _, missing, _ = cov.analysis2(path)
        missing, errors, spans, hooks = (
            set(missing),
            error_lines(tree),
            statement_lines(tree),
            hook_lines(tree, name == "grpo.py"),
        )
        prose = {} if code_only else prose_lines(source, tree)
        named = {k for k, words in prose.items() if PROSE_FEATURE.search(words) or PROSE_FAMILY.search(words)}
        in_functions, read, skipped, hooked, told, listing = set(), set(), set(), set(), set(), []
        records = {n.name for n in tree.body if isinstance(n, ast.ClassDef)} & {"Parts", "ModelParts"}
        for function, first, body, last, nested in functions(tree):
            own = set(range(first, last + 1)) - nested
            in_functions |= set(range(first, last + 1))
            if records and function in NOT_READ and not with_choose_parts:
                continue
            own_statements = [s for s in statements if s in own and s >= body]  # the def line runs at import
            if not any(s not in missing for s in own_statements):
                continue  # not entered: not read
            lines = {line for line in own if text[line - 1].strip()}
            ENTERED.append(f"{name[:-3]}.{function}")
            off_skipped = {
                line
                for s in own_statements
                if s in missing and s not in errors
                for line in spans.get(s, {s})
                if line in own
            }
            off_hooks = {line for line in lines & hooks if line not in missing} - off_skipped
            off_prose = (lines & named) - off_skipped - off_hooks
            read |= lines
            skipped |= off_skipped
            hooked |= off_hooks
            told |= off_prose
            if show and (off_skipped or off_hooks or off_prose):
                found = f"skipped {sorted(off_skipped)}, hooks {sorted(off_hooks)}, prose {sorted(off_prose)}"
                listing.append(f"    {function}: {found}")
        module_lines = {k for k in range(1, len(text) + 1) if k not in in_functions and text[k - 1].strip()}
        if with_module:
            module_off = (module_lines & (hooks | named)) - read
            read |= module_lines
            hooked |= module_off
            if show and module_off:
                listing.append(f"    <module>: {sorted(module_off)}")
        off = len(skipped) + len(hooked) + len(told)
        total_read, total_off = total_read + len(read), total_off + off
        print(
            f"{name:14s} {len(read):6d} {len(skipped):8d} {len(hooked):6d} {len(told):6d} {off:6d} "
            f"{len(module_lines):7d}"
        )
        if show:
            print("\n".join(listing))
    share = 100 * total_off / total_read
    print(f"{'all':14s} {total_read:6d} {'':8s} {'':6s} {'':6s} {total_off:6d}  ({share:.1f}% off)")
    return total_read, total_off


def main() -> None:
    if os.environ.get("LEARNER_READ_DATA"):  # a rank started below
        run_rank(os.environ["LEARNER_READ_TREE"], os.environ["LEARNER_READ_DATA"], sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list every off-feature line, by function")
    ap.add_argument("--tree", default=ROOT, help="the checkout to read (default: this one)")
    ap.add_argument("--with-choose-parts", action="store_true", help="count choose_parts as read (see the method)")
    ap.add_argument("--code-only", action="store_true", help="prose never off (the method before issue 60)")
    ap.add_argument("--with-module", action="store_true", help="count the files' module-level lines as read too")
    ap.add_argument("--entered", action="store_true", help="print every function the run entered, one per line")
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, ".coverage")
        env = {**os.environ, "LEARNER_READ_DATA": data_file, "LEARNER_READ_TREE": tree, "OMP_NUM_THREADS": "1"}
        argv = [*DEFAULT_RUN, f"trainer.output_dir={os.path.join(tmp, 'run')}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.abspath(__file__)]
        print(f"running in {tree}: torchrun --nproc_per_node 2 grpo.py", " ".join(DEFAULT_RUN))
        proc = subprocess.run([*cmd, *argv], cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        read, off = count(tree, data_file, args.list, args.with_choose_parts, args.code_only, args.with_module)
    if args.entered:
        print("entered:", " ".join(ENTERED))
    share, ok = 100 * off / read, 100 * off / read <= LIMIT and read <= READ_LIMIT
    verdict = "ok" if ok else "FAILED"
    print(f"{verdict}: {read} lines read (<= {READ_LIMIT}), {off} of them serve a feature that is off: {share:.1f}% "
          f"(<= {LIMIT:g}%)")  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

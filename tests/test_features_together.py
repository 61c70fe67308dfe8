"""Features together: for every pair of optional features that grpo.choose_parts admits, the parts it builds keep
what each feature needs; every other pair stops at start-up in one line. In process, no runs (configs from
config.load_config(["tiny.yaml"], overrides): one mini-batch and one epoch, so the on-policy shortcut is live unless a
feature turns it off).

What each feature needs is written here, from what the feature does (docs/features.md, the specs), not read from the
code: NEEDS, one row per feature, and REFUSED, the pairs that cannot run together. A pair's expectation is the union of
its two rows; what the parts do is read in ONE place, what_the_step_does (the only code here that knows Parts'
fields), as behaviour: where the update's old log-probs come from (grpo.on_policy_shortcut's verdict and bypass's
given ones), which functions each part of the step calls (the modules that define them: a feature's own in place of
plain GRPO's, or a wrapper around it whose inner part must stay), whether the run loads a reference.

The bug this was written for (issue 59): the GRPO family's block setting needs_old_pass from the KL in the reward
alone, dropping what R2 or a dump raised before it: RLOO with R2 then took the on-policy shortcut and replayed no
routing (rloo+R2, rloo+dump, rloo+replay and every estimator's pairs with them fail here)."""

import functools
import glob
import inspect
import itertools
import json
import os

import pytest
import torch
from test_multi_turn import tools_build  # noqa: F401  (the tiny_tools build, a module fixture)

import config
from conftest import ROOT, cli_calls

# feature -> its on-keys (overrides of tiny.yaml); {files} are filled in by the module's files fixture
FEATURES = {
    **{mode: [f"actor.policy_loss.loss_mode={mode}"] for mode in ("gspo", "cispo", "sapo", "geo_mean")},
    **{
        est: [f"algorithm.adv_estimator={est}"]
        for est in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
    },
    "kl_in_reward": ["algorithm.use_kl_in_reward=true"],
    "dynamic_sampling": ["algorithm.filter_groups.enable=true"],
    "multi_turn": ["rollout.multi_turn.enable=true"],
    "reward_file": ["custom_reward_function.path={reward_file}"],
    "overlong_buffer": [
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=16",
        "reward.overlong_buffer.penalty_factor=1.0",
    ],
    "dump": ["trainer.dump_batches={dump}"],
    "replay": ["trainer.replay_batches={dump}"],
    "R2": ["actor.router_replay.mode=R2"],
    "R3": ["actor.router_replay.mode=R3", "rollout.enable_rollout_routing_replay=true"],
    "routing_returned": ["rollout.enable_rollout_routing_replay=true"],  # a batch carrying routing, replay off
    "bypass": ["algorithm.rollout_correction.bypass_mode=true"],
    "rollout_is": ["algorithm.rollout_correction.rollout_is=token"],
    "rollout_rs": [
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=2",
    ],
    "lora": ["model.lora_rank=8"],
    "lora_adapter": ["model.lora_adapter_path={adapter}"],
    "agent": ["rollout.agent.path={agent}"],
    "distill": ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=tiny_teacher"],
}
LOSS_MODES, ESTIMATORS = (
    ("gspo", "cispo", "sapo", "geo_mean"),
    ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
)

# What each feature needs of the step. "old": where the update's old log-probs must come from:
#   "before the update"  the old log-probs exist before the update (an old-log-prob pass, or given ones)
#   "the old pass"       the trainer's old-log-prob pass itself (R2 records its routing; the IS weights and the
#                        rejection compare it with vLLM's)
#   "vLLM's"             vLLM's sampling log-probs stand as the old ones (bypass: no old pass)
# Without any, a run of one mini-batch and one epoch takes the update's own forward (the on-policy shortcut).
# The others: a step part -> the module whose function must be in it, either in place of plain GRPO's ("module": the
# feature's own function) or around whatever is there ("+module": it wraps it, and what it wraps must stay);
# "reference model": the run loads the reference without the KL loss.
NEEDS = {
    **{mode: {"policy_term": "grpo_family"} for mode in LOSS_MODES},
    **{est: {"advantages": "grpo_family"} for est in ESTIMATORS},
    "kl_in_reward": {  # the KL of the old policy to the reference, in the reward
        "advantages": "grpo_family",
        "old": "before the update",
        "reference model": True,
    },
    "dynamic_sampling": {"pick_groups": "dapo"},
    "multi_turn": {"sample": "multi_turn", "field_metrics": "multi_turn", "prompt_kwargs": "multi_turn"},
    "reward_file": {"score": "reward_files"},
    "overlong_buffer": {"scored_samples": "+dapo"},  # the penalty on the scored samples' lengths
    "dump": {"advantages": "+data", "old": "before the update"},  # a dump carries explicit old log-probs
    "replay": {"reference": "+data", "old": "before the update"},  # the dumped log-probs, not the update's forward
    # (and the dumped advantages in place of any estimator's: REPLACED_BY_REPLAY)
    "R2": {"old_logprobs": "+moe", "reference": "+moe", "update": "+moe", "old": "the old pass"},  # records, replays
    "R3": {"sample": "moe", "old_logprobs": "+moe", "update": "+moe"},  # vLLM's routing, a field of each sample
    "routing_returned": {"sample": "moe", "old_logprobs": "+moe", "update": "+moe"},
    "bypass": {"reference": "+rollout_correction", "old": "vLLM's"},  # vLLM's put in the batch before the reference
    "rollout_is": {"correct": "rollout_correction", "old": "the old pass"},
    "rollout_rs": {"correct": "rollout_correction", "old": "before the update"},  # with bypass: the current policy's
    "lora": {"reference": "+lora"},  # the reference's pass with the policy's adapters off
    "lora_adapter": {"reference": "+lora"},
    "agent": {"scored_samples": "agent", "sample_groups": "+agent", "advantages": "agent", "field_metrics": "agent"},
    # the teacher's pass before the task's advantages; its term beside the task's loss; the student's top-k in the
    # update's forward and veRL's metric names (a replay keeps the dump's teacher log-probs: REPLACED_BY_REPLAY)
    "distill": {"advantages": "+distill", "loss": "+distill", "update": "+distill"},
}
REPLACED_BY_REPLAY = "advantages"  # a replayed batch keeps its dumped advantages, whatever estimator made them
# Pairs that cannot run together, refused at start-up in one line naming a key of each (set: the pair, either order)
AGENT_REFUSES = ("multi_turn", "reward_file", "dynamic_sampling", "overlong_buffer", "kl_in_reward", *ESTIMATORS)
REFUSED = {
    *(frozenset(("agent", other)) for other in AGENT_REFUSES),  # the episodes score themselves; GRPO groups episodes
    frozenset(("R2", "bypass")),  # R2 replays the old pass's routing, which bypass skips (veRL refuses it)
    frozenset(("R2", "routing_returned")),  # R2 with the rollout's routing: R3's setting
    frozenset(("R3", "multi_turn")),  # multi-turn samples carry no routing
    frozenset(("routing_returned", "multi_turn")),
    frozenset(("R3", "replay")),  # dumps carry no routing
    frozenset(("routing_returned", "replay")),
    frozenset(("bypass", "rollout_is")),  # bypass applies no IS weights
    frozenset(("dump", "replay")),
    # an agent's samples carry no routing (agent.py asks the engine for none): R3 would replay nothing
    frozenset(("R3", "agent")),
    frozenset(("routing_returned", "agent")),
}
DEFAULTS = {  # plain GRPO's step: the module of each part's function, the on-policy shortcut, no reference needed
    "old": "the update's forward",
    "pick_groups": {"grpo"},
    "sample_groups": {"grpo"},
    "scored_samples": {"grpo"},
    "sample": {"rollout"},
    "score": {"data"},
    "old_logprobs": {"grpo"},
    "reference": {"grpo"},
    "correct": {"grpo"},
    "advantages": {"grpo"},
    "update": {"grpo"},
    "policy_term": {"grpo"},
    "loss": {"grpo"},
    "field_metrics": set(),
    "prompt_kwargs": {"grpo"},
    "reference model": False,
}
OLD_ORDER = ("vLLM's", "the old pass", "before the update")  # the first need present decides where they come from


def expected(features) -> dict:
    """What a step with these features does, from NEEDS alone: each part holds plain GRPO's function unless a
    feature puts its own in place, plus every feature's own (in place of the default, or around it); the old
    log-probs vLLM's if a feature says so, else the old pass if any feature needs them before the update; a replay's
    advantages the dump's; bypass with the rejection: the policy term rejecting against the current policy."""
    out = {k: (set(v) if isinstance(v, set) else v) for k, v in DEFAULTS.items()}
    for feature in features:
        for slot, need in NEEDS[feature].items():
            if slot == "old":
                continue
            if slot == "reference model":
                out[slot] = True
            elif need.startswith("+"):
                out[slot].add(need[1:])
            else:
                out[slot] = (out[slot] - DEFAULTS[slot]) | {need}
    if "replay" in features:
        out[REPLACED_BY_REPLAY] = {"data"}
    olds = {NEEDS[f].get("old") for f in features}
    for old in OLD_ORDER:
        if old in olds:
            out["old"] = "vLLM's" if old == "vLLM's" else "the old pass"
            break
    if {"bypass", "rollout_rs"} <= set(features):
        out["policy_term"].add("rollout_correction")  # rejecting, around the loss
    return out


PROJECT = {os.path.basename(path)[:-3] for path in glob.glob(os.path.join(ROOT, "*.py"))}  # the project's modules


def chain(fn, slot: str) -> set[str]:
    """The modules of a part's function and of every part it wraps: through functools.partial, and through the
    function a wrapper's closure holds under the part's own name (or moe.measured's `phase`). {} for no function."""
    found, todo = set(), [fn]
    while todo:
        fn = todo.pop()
        while isinstance(fn, functools.partial):
            fn = fn.func
        if fn is None or fn.__module__ not in PROJECT:  # a user's function (a reward file's): not a project part
            continue
        found.add(fn.__module__)
        if inspect.isfunction(fn) and fn.__closure__:
            inner = inspect.getclosurevars(fn).nonlocals
            todo += [inner[name] for name in (slot, "phase") if callable(inner.get(name))]
    return found


def what_the_step_does(cfg: dict, parts) -> dict:
    """THE ONE PLACE THAT READS grpo.Parts: what a step with these parts does, in NEEDS' terms. Where the old
    log-probs come from: vLLM's when bypass gives them (parts.given_old), else the update's forward when
    grpo.on_policy_shortcut says so, else the old-log-prob pass (grpo.setup's run.capture; grpo_step). Each part: the
    modules of the functions it calls (chain: a wrapper and what it wraps); whether the run loads the reference
    without the KL loss (parts.needs_reference)."""
    import grpo

    if parts.given_old:
        old = "vLLM's"
    else:
        old = "the update's forward" if grpo.on_policy_shortcut(cfg, parts) else "the old pass"
    slots = [slot for slot in DEFAULTS if slot not in ("old", "reference model")]
    return {
        "old": old,
        **{slot: chain(getattr(parts, slot), slot) for slot in slots},
        "reference model": parts.needs_reference,
    }


def same_key(a: str, b: str) -> bool:
    """Do two features set one key (two loss modes, two estimators, R2 and R3's mode)? Not a pair."""
    keys = lambda f: {o.split("=")[0] for o in FEATURES[f]}  # noqa: E731
    return bool(keys(a) & keys(b))


PAIRS = [pytest.param(a, b, id=f"{a}+{b}") for a, b in itertools.combinations(FEATURES, 2) if not same_key(a, b)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The files the features' keys name: a reward file, a dump directory, an agent file (its worker imports it at
    choose_parts), a PEFT LoRA adapter directory (choose_parts reads its adapter_config.json only)."""
    root = tmp_path_factory.mktemp("features")
    (root / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    (root / "agent.py").write_text("def episode(client, row):\n    return 0.0\n")
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return {"reward_file": root / "reward.py", "dump": root / "dump", "agent": root / "agent.py", "adapter": adapter}


def overrides(features, files: dict) -> list[str]:
    return [o.format(**files) for f in features for o in FEATURES[f]]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_alone_has_what_it_needs(files, feature):
    """The table's rows against the code one feature at a time (and plain GRPO, the base, its own defaults)."""
    import grpo

    base = config.load_config(["tiny.yaml"], [])
    assert what_the_step_does(base, grpo.choose_parts(base)) == DEFAULTS
    cfg = config.load_config(["tiny.yaml"], overrides([feature], files))
    assert what_the_step_does(cfg, grpo.choose_parts(cfg)) == expected([feature])


@pytest.mark.parametrize("first,second", PAIRS)
def test_every_pair_keeps_both_features_needs_or_stops_in_one_line(files, first, second):
    """A pair choose_parts admits: what the step does is what both features need (the union of their NEEDS rows:
    the old log-probs from where the strictest needs them, every slot and hook of both); a REFUSED pair: one line,
    an error of flatgrpo's, naming a key of each feature, before anything loads."""
    import grpo

    pair = (first, second)
    try:
        cfg = config.load_config(["tiny.yaml"], overrides(pair, files))
        parts = grpo.choose_parts(cfg)
    except Exception as e:
        assert frozenset(pair) in REFUSED, f"{pair} refused: {e}"
        assert grpo.one_line(e) and "\n" not in str(e), f"{pair}: not one line: {e!r}"
        for feature in pair:
            keys = [o.split("=")[0] for o in FEATURES[feature]]
            names = [*keys, *(k.split(".")[-1] for k in keys if "_" in k.split(".")[-1])]  # bypass_mode, ...
            assert any(k in str(e) for k in names), f"{pair}: the line names none of {feature}'s keys {keys}: {e}"
        return
    assert frozenset(pair) not in REFUSED, f"{pair} admitted: it should stop in one line"
    assert what_the_step_does(cfg, parts) == expected(pair), pair


# ------------------------------------------------------------------------------------ combination runs
# The combinations the docs recommend, each a short run (2 steps, 8 prompts x 4 samples, ONE mini-batch: the
# on-policy shortcut is live unless a feature needs the old pass), asserting what breaks when a feature's need is
# dropped. The 1-rank runs share one process (tests/helpers/cli_calls.py: vLLM imported once).
COMBINED = [
    "trainer.total_steps=2",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "rollout.n=4",
    "data.max_response_length=32",
    "trainer.val_every=0",
    "trainer.export_hf=false",
    "trainer.sync_check_every=1",
]
SYNC = 1e-4  # vLLM against the trainer after a push, fp32 (docs/cpu-notes.md)
LENGTH_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
LENGTH_REWARD += "    return (len(solution_str) % 3) / 2\n"  # rewards that vary within a group, even for a random model
ONE_CALL_AGENT = '''from reward import compute_score


def episode(client, row):
    """One chat completion of the row's prompt, scored with GSM8K's rule."""
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=list(row["prompt"]))
    return compute_score(reply.choices[0].message.content or "", row["ground_truth"])
'''


@pytest.fixture(scope="module")
def combination_runs(tiny_build, tiny_tokenizer, tmp_path_factory) -> dict:
    """{name: output directory} of the 1-rank combination runs, each dumping its batches into <dir>/dump:
    "lora_correction" (LoRA + the rollout correction's IS weights), "r2_rloo" (a tiny Qwen3-MoE, test_moe's, with R2
    and RLOO, rewards by LENGTH_REWARD), "agent_sapo" (ONE_CALL_AGENT with SAPO's loss)."""
    import transformers
    from test_moe import MOE

    import tiny

    root = tmp_path_factory.mktemp("combinations")
    moe = tiny.save_random_family_model(str(root / "moe"), tiny_tokenizer, transformers.Qwen3MoeConfig, seed=1, **MOE)
    (root / "length_reward.py").write_text(LENGTH_REWARD)
    (root / "agent.py").write_text(ONE_CALL_AGENT)
    runs = {
        "lora_correction": [
            "model.lora_rank=8",
            "algorithm.rollout_correction.rollout_is=token",
            "trainer.save_every=2",
        ],
        "r2_rloo": [
            f"model.path={moe}",
            "actor.router_replay.mode=R2",
            "algorithm.adv_estimator=rloo",
            f"custom_reward_function.path={root / 'length_reward.py'}",
        ],
        "agent_sapo": [f"rollout.agent.path={root / 'agent.py'}", "actor.policy_loss.loss_mode=sapo"],
    }
    calls = {
        name: ["--config", "tiny.yaml", *COMBINED, *keys]
        + [f"trainer.output_dir={root / name}", f"trainer.dump_batches={root / name / 'dump'}"]
        for name, keys in runs.items()
    }
    results = cli_calls(calls, root)
    for name, result in results.items():
        assert result["exit"] == 0, (name, result["stderr"][-3000:])
    return {name: root / name for name in runs}


def steps_of(out) -> list[dict]:
    from grpo_runs import read_metrics

    steps = [m for m in read_metrics(out) if "training/global_step" in m]
    assert [m["training/global_step"] for m in steps] == [1, 2]
    return steps


def test_lora_with_the_rollout_correction_weighs_the_merged_policys_samples(combination_runs):
    """LoRA + rollout_is=token: every step the old-log-prob pass runs and the IS weights are computed from it before
    the update: the dumped is_weights are min(exp(old - rollout), 2) on every sampled token (the formula on the
    dumped log-probs) and the correction's metrics are logged; vLLM serves base + adapters (its log-probs the
    trainer's); the policy trains adapters only (the checkpoint holds nothing else), the base the reference (KL 0 at
    step 1, > 0 at step 2)."""
    out = combination_runs["lora_correction"]
    steps = steps_of(out)
    for m in steps:
        assert m["timing_s/old_log_prob"] > 0 and m["rollout/logprob_diff_max"] <= SYNC
        assert "rollout_corr/rollout_is_mean" in m, sorted(k for k in m if k.startswith("rollout_corr/"))
    for step in (1, 2):
        b = torch.load(out / "dump" / f"step_{step}.pt")
        width = b["response_mask"].shape[1]
        sampled = b["attention_mask"][:, -width:].float()
        expected = torch.exp(b["old_logprobs"] - b["rollout_logprobs"]).clamp(max=2.0) * sampled
        assert torch.allclose(b["is_weights"], expected, rtol=1e-6, atol=0), step
        assert (b["is_weights"][sampled.bool()] > 0).all()
    assert steps[0]["actor/kl_loss"] == 0.0 and steps[1]["actor/kl_loss"] > 0
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(out / "checkpoints" / "step_2")).read_metadata().state_dict_metadata
    trained = [k for k in keys if k.startswith("model.")]
    assert trained and all(".lora_" in k for k in trained)


def test_r2_with_rloo_takes_the_old_pass_and_replays_its_routing(combination_runs):
    """R2 + RLOO on a tiny Qwen3-MoE, one mini-batch (the GRPO family's block once dropped R2's need: the on-policy
    shortcut, no routing replayed): every step the update is given the old-log-prob pass's routing
    (router_replay/update_actor/* logged; one mini-batch: its own routing is that one, disagreement 0), and the
    advantages are RLOO's on the dumped rewards: r_i minus the mean of the group's other rewards."""
    out = combination_runs["r2_rloo"]
    for m in steps_of(out):
        assert m["timing_s/old_log_prob"] > 0 and m["rollout/logprob_diff_max"] <= SYNC
        assert m.get("router_replay/update_actor/disagreement") == 0.0, sorted(k for k in m if "router" in k)
    for step in (1, 2):
        b = torch.load(out / "dump" / f"step_{step}.pt")
        rewards = b["rewards"].double().view(-1, 4)  # [prompts, n]
        others = (rewards.sum(-1, keepdim=True) - rewards) / 3
        expected = (rewards - others).flatten()[:, None] * b["response_mask"].double()
        assert rewards.std(-1).max() > 0  # the rewards vary within a group: the advantages are not all 0
        assert torch.allclose(b["advantages"].double(), expected, rtol=1e-5, atol=1e-6), step


def test_an_agent_with_sapo_trains_its_rows_with_sapos_loss(combination_runs):
    """An agent (one call per episode) + SAPO: the agent's metrics are logged (its parts in place), and every step's
    policy loss is SAPO's on the agent's rows, ratio 1 (one mini-batch, the weights that sampled): the mean over rows
    of -(2 / tau) A, tau 1 where A > 0 and 1.05 elsewhere (veRL's seq-mean-token-mean, forced for SAPO), from the
    dumped advantages; vanilla's loss would be the token mean of -A."""
    out = combination_runs["agent_sapo"]
    for step, m in zip((1, 2), steps_of(out), strict=True):
        assert "agent/error_rate" in m and m["agent/error_rate"] == 0.0
        assert m["rollout/logprob_diff_max"] <= SYNC
        b = torch.load(out / "dump" / f"step_{step}.pt")
        mask = b["response_mask"].double()
        advantage = (b["advantages"].double() * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]: one per row
        tau = torch.where(advantage > 0, 1.0, 1.05).double()
        has_tokens = (mask.sum(-1) > 0).double()
        expected = (-(2 / tau) * advantage * has_tokens).sum() / mask.shape[0]
        assert advantage.abs().max() > 0
        assert m["actor/pg_loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7), step


def test_multi_turn_on_a_rollout_rank_dumps_its_turns_and_trains_the_models_tokens_only(tools_build, tmp_path):  # noqa: F811
    """Multi-turn (tiny.py's tiny_tools model and calculator) with 1 trainer rank and 1 rollout rank: the rollout
    rank samples with the tools (its parts are the run's), and the trainer rank trains the model's own tokens
    only: in every dumped batch the response mask is exactly the assistant turns' sampled tokens, vLLM's log-probs
    are 0 on the tool tokens (some rows have them), the turn counts are the logged num_turns/mean, and vLLM's
    log-probs are the trainer's."""
    from grpo_runs import run_grpo

    out = tmp_path / "run"
    multi_turn = ["model.path=tiny_tools", "rollout.multi_turn.enable=true", "rollout.multi_turn.max_assistant_turns=3"]
    run_grpo(
        out,
        2,
        *COMBINED,
        *multi_turn,
        "data.max_response_length=96",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n_gpus_per_node=1",
        f"trainer.dump_batches={out / 'dump'}",
    )
    for step, m in zip((1, 2), steps_of(out), strict=True):
        assert m["rollout/logprob_diff_max"] <= SYNC and "tool_calls/per_sample" in m
        b = torch.load(out / "dump" / f"step_{step}.pt")
        width = b["response_mask"].shape[1]
        sampled = b["attention_mask"][:, -width:].bool()  # [B, R]
        turn = b["turn_ids"]  # [B, R]: 1, 3, 5: the model's turns; 2, 4: tool responses; 0: padding
        assert torch.equal(turn > 0, sampled)
        assert torch.equal(b["response_mask"].bool(), (turn % 2 == 1) & sampled)
        tool = (turn % 2 == 0) & sampled
        assert tool.any() and (b["rollout_logprobs"][tool] == 0).all()
        assert m["num_turns/mean"] == pytest.approx(b["num_turns"].float().mean().item())

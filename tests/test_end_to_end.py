"""grpo.py end to end on the tiny model: runs at world sizes 1 and 2, veRL's metric keys, dumps and their replay at
another world size, resume after a kill, the on-policy shortcut against the separate old-log-prob pass, the run-time
proofs that stop a run (a skipped push, the fp32 rule), evaluation (val_only, sampled validation) and a user's reward
file, and the console of a long run."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

import config
import fsdp_train
import metrics
import reward
import rollout
from conftest import CONSTANT, ROOT, threads
from grpo_runs import (
    SMALL,
    VAL_KEY,
    comparable,
    one_error_line,
    read_jsonl,
    read_metrics,
    run_grpo,
    write_jsonl,
)

VERL_KEYS = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
    "actor/kl_coef",
    "actor/grad_norm",
    "actor/lr",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/returns/min",
    "response_length/mean",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "prompt_length/clip_ratio",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "timing_per_token_ms/gen",
    "timing_per_token_ms/update_actor",
    "perf/throughput",
    "perf/time_per_step",
    "perf/total_num_tokens",
    "perf/mfu/actor",
    "rollout/logprob_diff_max",
    "rollout/logprob_diff_mean",
]


@pytest.fixture(scope="module")
def val_file(tiny_build, tmp_path_factory):
    """(path, expected greedy mean@1): 7 validation rows (odd, so 2 ranks get 4 and 3) in veRL's layout;
    rows 0, 2, 4 and 6 carry as ground truth what the model answers greedily (HF generate here, an
    independent decoder; read with reward.method=flexible, which takes "12." from "The answer is 12."),
    the others a wrong one. The runs' step-0 validation must give exactly the expected score."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_build["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["test"]) as f:
        questions = [json.loads(line)["question"] for line in f][:7]
    rows, scores = [], []
    for i, question in enumerate(questions):
        prompt = reward.make_prompt(question)
        ids = rollout.render_prompt(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        answer = reward.extract_solution(text, "flexible")
        truth = str(answer) if i % 2 == 0 and answer else "-12345"
        rows.append({"prompt": prompt, "reward_model": {"ground_truth": truth}})
        scores.append(reward.compute_score(text, truth, method="flexible"))
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    write_jsonl(path, rows)
    assert 0 < sum(scores) < len(scores)
    return str(path), sum(scores) / len(scores)


@pytest.fixture(scope="module")
def hub_cache(tiny_build, tmp_path_factory) -> dict:
    """The environment of an offline machine whose Hugging Face cache holds the tiny model as the hub repo
    flatgrpo/tiny-grpo, in the layout snapshot_download writes (models--org--name, refs/main, snapshots)."""
    root = tmp_path_factory.mktemp("hub")
    repo, revision = root / "models--flatgrpo--tiny-grpo", "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_build["model"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root)}


@pytest.fixture(scope="module")
def e2e(tiny_build, val_file, hub_cache, tmp_path_factory):
    """{nproc: (out dir, the finished process)} of a 3-step tiny run at 1 and at 2 ranks, with the model
    given as a hub id (model.path=flatgrpo/tiny-grpo, resolved offline from hub_cache), dumping every
    batch to <out>/dump."""
    runs = {}
    for nproc in (1, 2):
        out = tmp_path_factory.mktemp(f"e2e{nproc}")
        proc = run_grpo(out / "run", nproc, *e2e_overrides(out, val_file), env=hub_cache)
        runs[nproc] = (out, proc)
    return runs


def e2e_overrides(out, val_file) -> list[str]:
    """The end-to-end runs' overrides (to SMALL), with their dumps in <out>/dump."""
    return [
        "trainer.save_every=2",
        f"trainer.dump_batches={out / 'dump'}",
        f"data.val={val_file[0]}",
        "reward.method=flexible",
        "model.path=flatgrpo/tiny-grpo",
    ]


LIBRARY_LINE = re.compile(r"\b(INFO|WARNING|Warning|FutureWarning)\b|Failed to load weights")


@pytest.mark.parametrize("nproc", [1, 2])
def test_end_to_end_tiny_run(e2e, val_file, nproc):
    out, proc = e2e[nproc][0] / "run", e2e[nproc][1]
    console = [
        line
        for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("grpo:")
    ]  # tqdm's redraws start with "grpo:"
    assert len(console) <= 20, console  # ours: what runs, data, validation, a line per step, the summary
    assert not [line for line in console if LIBRARY_LINE.search(line)], console  # no engine chatter, no warning
    assert "metrics.jsonl" in proc.stdout and "flatgrpo: model flatgrpo/tiny-grpo" in proc.stdout
    with open(out / "engine.log") as f:
        engine_log = f.read()
    assert "vllm" in engine_log and "Failed to load weights" in engine_log  # routed there, not lost
    step_lines = [line for line in console if re.match(r"step +\d+  score ", line)]
    assert [int(line.split()[1]) for line in step_lines] == [1, 2, 3]  # one line per step, by rank 0 only
    assert [line.split(":")[0] for line in console if line.startswith("step ") and VAL_KEY in line] == [
        "step 0",
        "step 2",
        "step 3",
    ]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", VAL_KEY}
    assert rows[0][VAL_KEY] == pytest.approx(val_file[1])  # a global mean over all 7 rows, at any world size
    for r in rows[1:]:
        assert set(VERL_KEYS) <= set(r), set(VERL_KEYS) - set(r)
        assert r["rollout/logprob_diff_max"] < 1e-3  # vLLM serves the trained weights
        assert r["rollout_corr/kl"] == pytest.approx(0, abs=1e-4) and "rollout_corr/chi2_token" in r
        assert 0 <= r["critic/score/mean"] <= 1 and r["perf/total_num_tokens"] > 8 * 8 * 40
        assert r["response_length/max"] <= 32 and r["actor/lr"] == 1e-4
    assert VAL_KEY in rows[2] and VAL_KEY in rows[3]
    assert [r["rollout/sync_check"] < 1e-3 for r in rows[1:] if "rollout/sync_check" in r] == [True] * 3
    assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000
    assert os.path.exists(os.path.join(out, "hf", "model.safetensors"))
    assert [os.path.basename(p) for p in fsdp_train.list_checkpoints(os.path.join(out, "checkpoints"))] == [
        "step_2",
        "step_3",
    ]


@pytest.mark.parametrize("nproc", [1, 2])
def test_dumped_batches_hold_the_right_prompts_rewards_and_advantages(e2e, tiny_build, nproc):
    """The loop's wiring, read back from its own dump: sample k of step s answers the step's prompt
    k // n, its reward is veRL's score of its decoded response against THAT prompt's answer, and its
    advantage is its reward normalised within its group of n (computed here from the formula)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["train"]) as f:
        train = [json.loads(line) for line in f]
    batch_size, n = 8, 8
    for step in (1, 2, 3):
        d = torch.load(e2e[nproc][0] / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        assert d["input_ids"].shape[0] == batch_size * n
        for k in range(batch_size * n):
            row = train[(step - 1) * batch_size + k // n]  # shuffle off: the step's prompts in order
            prompt = d["input_ids"][k, :-width][d["attention_mask"][k, :-width].bool()].tolist()
            assert prompt == rollout.render_prompt(tokenizer, reward.make_prompt(row["question"]))
            text = tokenizer.decode(d["input_ids"][k, -width:][d["response_mask"][k].bool()], skip_special_tokens=True)
            truth = reward.extract_ground_truth(row["answer"])
            assert d["rewards"][k].item() == reward.compute_score(text, truth, method="flexible")
        groups = d["rewards"].reshape(batch_size, n)  # [prompts, n]
        expected = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)  # [prompts, n]
        assert torch.allclose(d["advantages"], expected.reshape(-1, 1) * d["response_mask"], atol=1e-6)
    assert 0 < sum(torch.load(e2e[nproc][0] / "dump" / f"step_{s}.pt")["rewards"].sum() for s in (1, 2, 3)) < 3 * 64


def test_killed_and_resumed_run_logs_the_same_metrics(e2e, val_file, hub_cache, tmp_path):
    """The 1-rank end-to-end run again, killed (-9) once step 2 is logged (after its checkpoint) and resumed: the
    same metrics as the uninterrupted run, step by step."""
    killed = tmp_path / "killed"
    overrides = e2e_overrides(tmp_path, val_file)
    proc = run_grpo(killed, 1, *overrides, env=hub_cache, background=True)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill -9 once step 2 is logged (the step-2 checkpoint is written before)
        if os.path.exists(os.path.join(killed, "metrics.jsonl")) and any(r["step"] == 2 for r in read_metrics(killed)):
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(r["step"] for r in read_metrics(killed)) == 2
    run_grpo(killed, 1, *overrides, "trainer.resume=auto", env=hub_cache)
    a, b = read_metrics(e2e[1][0] / "run"), read_metrics(killed)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    # two mini-batches per step (4 of 8 prompts): the second one's old log-probs must be those of the policy that
    # SAMPLED, not of the one the first mini-batch already moved: the on-policy shortcut must be off
    assert all(r["timing_s/old_log_prob"] > 0 and r["actor/ppo_kl"] != 0.0 for r in a[1:])
    # a resumed set-up leaves the RNGs as the checkpoint saved them, although vLLM re-seeds them at start-up
    proc = subprocess.run(
        [
            sys.executable,
            "tests/helpers/setup_worker.py",
            os.path.join(killed, "checkpoints", "step_3"),
            "--config",
            "tiny.yaml",
            *SMALL,
            *overrides,
            f"trainer.output_dir={killed}",
            "trainer.resume=auto",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **hub_cache, "OMP_NUM_THREADS": threads(1)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "start": 4,
        "engine": True,
        "torch": True,
        "python": True,
        "numpy": True,
    }


def test_dump_at_one_rank_replay_at_two(e2e, tmp_path):
    """The seed's Experiment 1: the dumped batches replayed at another world size give the same update:
    every metric both runs log (not the timings; rollout/* compares with vLLM in one, the dump in the other)."""
    run_grpo(tmp_path / "replay", 2, f"trainer.replay_batches={e2e[1][0] / 'dump'}", "trainer.export_hf=false")
    a, b = read_metrics(e2e[1][0] / "run"), read_metrics(tmp_path / "replay")
    assert [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a[1:], b, strict=True):
        keys = [k for k in comparable(x) if k in y and not k.startswith("rollout/")]
        assert len(keys) >= 30
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
        assert y["rollout/logprob_diff_max"] < 1e-4  # recomputed old log-probs == the dumped ones


def test_the_on_policy_shortcut_only_where_the_sampling_policy_is_the_one_updated():
    """grpo.on_policy_shortcut: one mini-batch and one epoch, nothing that needs the old log-probs before the
    update, no dump or replay. Each condition alone turns it off (the end-to-end runs take one configuration each)."""
    import grpo

    base = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    cfg = config.load_config(None, base)
    assert grpo.on_policy_shortcut(cfg, grpo.choose_parts(cfg))
    rs = ["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"]
    for extra in (
        ["actor.ppo_mini_batch_size=4"],
        ["actor.ppo_epochs=2"],
        ["actor.recompute_old_log_prob=true"],
        ["algorithm.rollout_correction.rollout_is=token"],
        rs,
        ["trainer.dump_batches=dump"],
        ["trainer.replay_batches=dump"],
        ["algorithm.use_kl_in_reward=true"],
        ["actor.router_replay.mode=R2"],
    ):
        cfg = config.load_config(None, base + extra)
        assert not grpo.on_policy_shortcut(cfg, grpo.choose_parts(cfg)), extra


def test_on_policy_shortcut_equals_the_separate_old_log_prob_pass(tmp_path, tiny_build):
    """One mini-batch, one epoch: the update's own forward replaces veRL's old-log-prob pass (ratio = 1).
    In a sequence-level aggregation mode, so that every metric's aggregation is checked on both paths,
    with the recipe's entropy bonus and a sampling temperature other than 1."""
    common = [
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        "actor.ppo_mini_batch_size=8",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.entropy_coeff=0.003",
        "rollout.temperature=0.7",
    ]
    run_grpo(str(tmp_path / "short"), 1, *common)
    run_grpo(str(tmp_path / "full"), 1, *common, "actor.recompute_old_log_prob=true")
    short, full = read_metrics(str(tmp_path / "short")), read_metrics(str(tmp_path / "full"))
    assert all(r["timing_s/old_log_prob"] == 0.0 for r in short) and all(r["timing_s/old_log_prob"] > 0 for r in full)
    for a, b in zip(short, full, strict=True):
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/entropy",
            "actor/kl_loss",
            "critic/score/mean",
            "rollout/logprob_diff_mean",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["actor/ppo_kl"] == 0.0 and abs(b["actor/ppo_kl"]) < 1e-6  # ratio exactly / nearly 1


# ------------------------------------------------------------------------------ the sync proof
def test_sync_rule_on_recorded_numbers():
    """metrics.sync_verdict(mean, max, exact, max_fp32=1e-3, warn_mean=0.1) on measured rollout/logprob_diff_*."""

    def verdict(mean, worst, exact):
        return metrics.sync_verdict(mean, worst, exact, 1e-3, 0.1)

    assert verdict(2e-6, 2e-5, exact=True) is None  # fp32, correct push (tiny demo)
    assert verdict(0.0069, 1.7, exact=True) == "stop"  # fp32, the step after a skipped push (tiny, lr 1e-4)
    assert verdict(0.03, 1.29, exact=True) == "stop"  # fp32, a Gemma-2-like soft-cap left out of the trainer
    assert verdict(0.0019, 0.2, exact=False) is None  # bf16, correct push: rare tokens off by 0.2 nats (tiny)
    for mean in (0.011, 0.031, 0.064):  # bf16 rounding noise, Qwen-size models (public measurements)
        assert verdict(mean, 5.0, exact=False) is None
    assert verdict(0.33, 8.1, exact=False) == "warn"  # bf16, one step after a skipped push (tiny, lr 1e-3)


@pytest.mark.parametrize("key", ["rollout/logprob_diff_max", "rollout/sync_check"])
@pytest.mark.parametrize("threshold, gap", [(1e-4, 5e-4), (0.05, 0.01)])
def test_the_fp32_stop_is_trainer_logprob_diff_max_fp32(key, threshold, gap):
    """metrics.judge_sync on an fp32 run with a gap between the default 1e-3 and a configured threshold, on either
    probe: it stops exactly when the gap is above trainer.logprob_diff_max_fp32, with one line naming that key's
    value, and never on a bf16 run (its rule is the mean's)."""
    cfg = config.load_config(None, [f"trainer.logprob_diff_max_fp32={threshold}"])
    gaps = {key: gap, "rollout/logprob_diff_mean": gap / 10}
    if gap > threshold:  # below the default: stops only if the configured threshold is read
        with pytest.raises(metrics.OutOfSync) as stop:
            metrics.judge_sync(cfg, 0, 3, gaps, exact=True)
        assert f"({key}) in an fp32 run, above trainer.logprob_diff_max_fp32 = {threshold:g}" in str(stop.value)
    else:  # above the default: runs on only if the configured threshold is read
        metrics.judge_sync(cfg, 0, 3, gaps, exact=True)
    metrics.judge_sync(cfg, 0, 3, gaps, exact=False)


def test_the_printed_config_reaches_a_pipe_whole():
    """`python grpo.py --print-config | ...` with PYTHONUNBUFFERED unset: stdout is a pipe, so Python buffers it,
    and the process ends with os._exit (cluster.end_process), which must flush it first: the whole config,
    parsed back equal to the merged one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(
        [sys.executable, "grpo.py", "--config", "tiny.yaml", "--print-config", "actor.lr=2e-5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = config.load_config(os.path.join(ROOT, "tiny.yaml"), ["actor.lr=2e-5"])
    assert yaml.safe_load(proc.stdout) == expected and len(proc.stdout) > 1000


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_skipped_push_stops_an_fp32_run_and_warns_in_bf16(tmp_path, tiny_build, dtype):
    """tests/helpers/grpo_without_push.py leaves the engine on the initial weights. The exact proof
    (sync.check_push) stops the run at step 1's push, in one line naming the step and the group (bf16 here; every
    engine kind in process: tests/test_push_proof.py). The log-prob probe alone (the proof switched off): the step
    after, it stops an fp32 run with one line, once that step is logged (max rule), and warns in bf16 (mean rule). A
    correct bf16 run, whose rare tokens differ by more than the fp32 threshold, does not warn. (A correct fp32 run not
    stopping: the end-to-end runs.)"""
    common = [
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        "trainer.plot=false",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "data.max_response_length=24",
        "actor.lr=1e-3",
        "trainer.sync_check_every=0",
        f"rollout.dtype={dtype}",
        f"model.compute_dtype={dtype}",
    ]
    probe_only = {"WITHOUT_PUSH_PROOF": "1"}
    skipped = run_grpo(
        tmp_path / "skipped", 1, *common, script="tests/helpers/grpo_without_push.py", check=False, env=probe_only
    )
    if dtype == "float32":
        line = one_error_line(skipped)
        assert line.startswith("error: step 2: vLLM's and the trainer's log-probs differ by "), line
        assert "(rollout/logprob_diff_max) in an fp32 run, above trainer.logprob_diff_max_fp32 = 0.001" in line
        logged = read_metrics(tmp_path / "skipped")
        assert [r["training/global_step"] for r in logged] == [1, 2] and logged[1]["rollout/logprob_diff_max"] > 1e-3
        return
    assert skipped.returncode == 0
    assert (
        "WARNING step 1" not in skipped.stdout
        and "WARNING step 2: vLLM's and the trainer's log-probs differ" in skipped.stdout
    )
    proven = run_grpo(tmp_path / "proven", 1, *common, script="tests/helpers/grpo_without_push.py", check=False)
    line = one_error_line(proven)
    assert line.startswith("error: step 1: the engine's ") and "is not what the trainer pushed" in line, line
    assert not os.path.exists(tmp_path / "proven" / "metrics.jsonl") or not read_metrics(tmp_path / "proven")
    correct = run_grpo(tmp_path / "correct", 1, *common)
    assert "WARNING" not in correct.stdout
    assert max(r["rollout/logprob_diff_max"] for r in read_metrics(tmp_path / "correct")) > 0.05


@pytest.mark.parametrize("which", ["initial", "exported"])
def test_val_only_logs_what_the_training_run_validated(e2e, val_file, hub_cache, tmp_path, which):
    """trainer.val_only on the model the 1-rank run started from (its step-0 validation) and on its hf/ export
    (its last validation): the same greedy mean@1, printed and logged, and nothing else written."""
    trained = read_metrics(e2e[1][0] / "run")
    model, expected = (
        ("flatgrpo/tiny-grpo", trained[0][VAL_KEY])
        if which == "initial"
        else (str(e2e[1][0] / "run" / "hf"), trained[-1][VAL_KEY])
    )
    out = tmp_path / "eval"
    proc = run_grpo(
        out,
        1,
        "trainer.val_only=true",
        f"data.val={val_file[0]}",
        "reward.method=flexible",
        f"model.path={model}",
        env=hub_cache,
    )
    assert read_jsonl(out / "val_metrics.jsonl") == [{"step": 0, VAL_KEY: expected}]
    assert f"step 0: {VAL_KEY} = {expected:.3f}" in proc.stdout
    assert sorted(os.listdir(out)) == ["engine.log", "val_metrics.jsonl"]  # no checkpoint, export, config, curves


@pytest.fixture(scope="module")
def sampled_validation(tiny_build, val_file, tmp_path_factory) -> dict:
    """{nproc: (the samples trainer.validation_data_dir dumped, the logged metrics)} of trainer.val_only with
    rollout.val_n=4 at temperature 1 on the 7 rows of val_file, at 1 and at 2 ranks (4 + 3 rows). The TRAINING
    sampling keys are set greedy (top_k 1, top_p 0.01, temperature 0.01): validation that read any of them in
    place of its val_* key would draw 4 equal samples per prompt."""
    out = {}
    for nproc in (1, 2):
        root = tmp_path_factory.mktemp(f"sampled{nproc}")
        run_grpo(
            root / "eval",
            nproc,
            "trainer.val_only=true",
            f"data.val={val_file[0]}",
            "reward.method=flexible",
            "rollout.val_n=4",
            "rollout.val_temperature=1.0",
            "rollout.temperature=0.01",
            "rollout.top_k=1",
            "rollout.top_p=0.01",
            f"trainer.validation_data_dir={root / 'generations'}",
        )
        out[nproc] = read_jsonl(root / "generations" / "0.jsonl"), read_jsonl(root / "eval" / "val_metrics.jsonl")[0]
    return out


def test_sampled_validation_metrics_equal_verls_computation_on_the_samples(sampled_validation):
    """rollout.val_n=4 at temperature 1, 2 ranks: the logged val-core mean@4, best@4/mean and maj@4/mean (and every
    other key) equal veRL's process_validation_metrics written out literally (tests/test_val_metrics.py) on the
    dumped samples, whose rewards and votes are veRL's GSM8K scores and answers of their texts."""
    samples, logged = sampled_validation[2]
    assert sorted(s["uid"] for s in samples) == sorted(list(range(7)) * 4)
    for s in samples:
        assert s["reward"] == reward.compute_score(s["output"], s["gts"], method="flexible")
        assert s["pred"] == (reward.extract_solution(s["output"], "flexible") or "[no answer]")
    from test_val_metrics import reference

    expected = reference([{k: s[k] for k in ("data_source", "uid", "reward", "pred")} for s in samples])
    core, aux = "val-core/openai/gsm8k/reward/", "val-aux/openai/gsm8k/reward/"
    assert {core + k for k in ("mean@4", "best@4/mean", "maj@4/mean")} | {
        aux + "best@2/mean",
        aux + "maj@2/mean",
    } <= set(logged)
    assert {k: v for k, v in logged.items() if k != "step"} == pytest.approx(expected, rel=1e-12)
    assert len({s["output"] for s in samples}) > 7  # sampled, not greedy


def test_sampled_validation_is_the_same_at_one_and_two_ranks(sampled_validation):
    """Validation seeds follow the global prompt index (trainer.seed + index * val_n), not the rank's share: 1 rank
    (7 prompts) and 2 ranks (4 + 3) draw the same samples of every prompt, in the same order, and log the same
    metrics."""

    def by_prompt(samples: list[dict]) -> dict[int, list[str]]:
        outputs = {}
        for s in samples:
            outputs.setdefault(s["uid"], []).append(s["output"])
        return outputs

    (one, logged_one), (two, logged_two) = sampled_validation[1], sampled_validation[2]
    assert by_prompt(one) == by_prompt(two) and len(by_prompt(one)) == 7
    assert logged_one == logged_two


def test_a_constant_reward_file_gives_exactly_that_score(tiny_build, val_file, reward_files, tmp_path):
    """Training and validation both score with the file (val_only with a reward file: the NaN test below)."""
    train = run_grpo(
        tmp_path / "train",
        1,
        f"custom_reward_function.path={reward_files['constant']}",
        f"data.val={val_file[0]}",
        "trainer.total_steps=1",
        "trainer.val_every=1",
        "trainer.save_every=0",
    )
    rows = read_metrics(tmp_path / "train")
    assert rows[0][VAL_KEY] == CONSTANT and rows[1][VAL_KEY] == CONSTANT
    assert rows[1]["critic/score/mean"] == rows[1]["critic/score/min"] == CONSTANT and rows[1]["actor/pg_loss"] == 0.0
    assert "error" not in train.stderr


def test_a_reward_of_nan_stops_the_run_with_one_line_naming_the_row(tiny_build, reward_files, tmp_path):
    """val_only with a reward file that returns NaN for the validation file's row 2 only: the run stops at that
    row, with the one line that names it."""
    nan_file = reward_files["nan_at_row_2"]
    proc = run_grpo(
        tmp_path / "run", 1, f"custom_reward_function.path={nan_file}", "trainer.val_only=true", check=False
    )
    line = one_error_line(proc)
    assert line.startswith(f"error: custom_reward_function: {nan_file}:compute_score returned nan for ")
    assert line.endswith("test.jsonl row 2; accepted: a finite number, or a dict with a numeric 'score'")


@pytest.mark.parametrize(
    "returned", ["float('nan')", "float('inf')", "-float('inf')", "{'score': float('nan')}", "'abc'"]
)
def test_a_reward_file_must_return_a_finite_number(tmp_path, returned):
    """The loop's scorer of a reward file (grpo.choose_parts' score: reward_files.load_scorer): a reward that is not
    a finite number (NaN, +-inf, a dict whose score is NaN, text) stops the run with the file, the function, what
    it returned and the row it was scoring."""
    import grpo
    import reward_files

    path = tmp_path / "reward.py"
    path.write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {returned}\n"
    )
    score = grpo.choose_parts(config.load_config(None, [f"custom_reward_function.path={path}"])).score
    row = {"data_source": "my/task", "ground_truth": "1", "extra_info": {}, "where": "val.jsonl row 5"}
    with pytest.raises(
        reward_files.RewardFileError,
        match=rf"^custom_reward_function: {path}:compute_score returned .+ for val.jsonl row 5; accepted",
    ):
        score(row, "text", {})


def test_the_example_reward_file_trains(tiny_build, tmp_path):
    """examples/gsm8k_partial_credit.py (veRL's format, a dict with acc and pred): 3 steps; every dumped reward is 1
    where veRL's strict GSM8K rule scores the text 1, 0.1 where it finds another "#### N", else 0; its acc becomes
    the val-core metric (veRL's rule) and is logged as a training mean. With data.shuffle on and trainer.seed 3
    (not 0, which would hide a seed left out): each step's prompts are those of the documented per-epoch
    permutation, random.Random(seed * 100_003 + epoch).shuffle(range(rows)) (docs/verl-mapping.md)."""
    run_grpo(
        tmp_path / "run",
        1,
        "custom_reward_function.path=examples/gsm8k_partial_credit.py",
        f"trainer.dump_batches={tmp_path / 'dump'}",
        "trainer.val_every=3",
        "trainer.save_every=0",
        "data.shuffle=true",
        "trainer.seed=3",
    )
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val-core/openai/gsm8k/acc/mean@1" in rows[0] and "val-aux/openai/gsm8k/reward/mean@1" in rows[0]
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["train"]) as f:
        train = [json.loads(line) for line in f]
    order = list(range(len(train)))
    random.Random(3 * 100_003 + 0).shuffle(order)  # epoch 0: steps 1-3 of 8 prompts
    assert order[:24] != list(range(24))
    for step in (1, 2, 3):
        d = torch.load(tmp_path / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        for k in range(d["input_ids"].shape[0]):
            row = train[order[(step - 1) * 8 + k // 8]]
            prompt = d["input_ids"][k, :-width][d["attention_mask"][k, :-width].bool()].tolist()
            assert prompt == rollout.render_prompt(tokenizer, reward.make_prompt(row["question"]))
            text = tokenizer.decode(
                d["input_ids"][k, -width:][d["attention_mask"][k, -width:].bool()], skip_special_tokens=True
            )
            truth = reward.extract_ground_truth(row["answer"])
            right, found = reward.compute_score(text, truth) == 1.0, reward.extract_solution(text) is not None
            assert d["rewards"][k].item() == pytest.approx(1.0 if right else 0.1 if found else 0.0)
        assert rows[step]["reward_extra_info/acc/mean"] == pytest.approx(
            sum(float(r == 1.0) for r in d["rewards"].tolist()) / len(d["rewards"])
        )


def test_a_ten_step_run_in_a_log_file_is_one_line_per_step(tiny_build, tmp_path):
    """In a file (SLURM output, nohup, CI: not a terminal) no progress bar redraws: one line per step.
    The run is also the loop's wiring check of the GRPO family: REINFORCE++ with the adaptive KL in the reward
    and GSPO, in one mini-batch (so the on-policy shortcut gives way to the old-log-prob pass the KL needs, and
    the reference model is loaded for the reward alone). Each step's coefficient follows veRL's
    AdaptiveKLController from the previous step's logged KL (8 rows: n_steps)."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        subprocess.run(
            [
                sys.executable,
                "grpo.py",
                "--config",
                "tiny.yaml",
                f"trainer.output_dir={tmp_path / 'run'}",
                "trainer.total_steps=10",
                "trainer.val_every=5",
                "data.val_max_samples=8",
                "data.train_batch_size=2",
                "actor.ppo_mini_batch_size=2",
                "rollout.n=4",
                "data.max_response_length=16",
                "trainer.save_every=0",
                "actor.lr=1e-4",
                "actor.use_kl_loss=false",
                "actor.policy_loss.loss_mode=gspo",
                "algorithm.adv_estimator=reinforce_plus_plus",
                "algorithm.use_kl_in_reward=true",
                "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.horizon=100",
                "algorithm.kl_ctrl.target_kl=0.001",
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": threads(1)},
        )
    lines = log.read_text().splitlines()
    assert len(lines) <= 25, lines
    assert sum(line.startswith("step ") and "s/step" in line for line in lines) == 10
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert rows[0]["actor/reward_kl_penalty_coeff"] == 0.001 and rows[0]["actor/reward_kl_penalty"] == 0.0  # pi = ref
    assert all(r["timing_s/old_log_prob"] > 0 and "actor/kl_loss" not in r for r in rows)
    assert max(r["actor/reward_kl_penalty"] for r in rows) > 0
    for a, b in zip(rows, rows[1:], strict=False):
        error = min(max(a["actor/reward_kl_penalty"] / 0.001 - 1, -0.2), 0.2)  # veRL: np.clip(kl / target - 1)
        expected = a["actor/reward_kl_penalty_coeff"] * (1 + error * 8 / 100)
        assert b["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-12)
    assert rows[-1]["actor/reward_kl_penalty_coeff"] != 0.001

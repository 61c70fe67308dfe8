"""Rollout ranks (rollout_ranks.py): 3-process CPU runs under torchrun, 2 trainer ranks and 1 rollout rank, two
mini-batches a step, sampled, validated; the runs are shared by the tests (module fixtures).

- k = 0 (async_training.staleness_threshold): the same metrics and bit-identical weights as the same seeded
  colocated 2-rank run.
- k = 1, proven from its dumps and per-step checkpoints with an independent computation (HF's model in float64
  on the checkpoint's weights; tolerances: tests/helpers/fp32_noise.py): batch s was sampled by the weights of step s -
  2; vLLM's log-probs are that policy's at fp32 noise and not the current one's; the old-log-prob pass is the current
  policy's; the IS weights and advantages are the formulas on the dumped batch; the update equals a colocated
  replay of the dumped batches (trainer.replay_batches: the update tests/test_loop.py checks against the formulas).
- k = 2 (1 trainer rank, 1 rollout rank), the same way: the batches at the bound (staleness 2), each proven
  against the kept weights that sampled it.
- k = 1, stopped by a signal to one trainer rank, and to a rollout rank (1 + 1 and 2 + 2 ranks: SIGTERM, then
  SIGKILL after a grace period), and resumed: every generation batch trained on once, none lost.
- A message between trainer and rollout ranks read only as the answer it names (a real gloo pair).
- One line for a topology that cannot run.
"""

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file
from test_cluster import wait_for_step, worker_of_rank
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

import fp32_noise
import fsdp_train
import tiny
from conftest import ROOT, cli_calls, free_port
from grpo_runs import SMALL, comparable, read_metrics, run_grpo

RANKS = ["rollout.n_gpus_per_node=1"]  # 1 rollout rank; torchrun's 3 processes leave 2 trainer ranks
ONE_STEP_OFF = [
    *RANKS,
    "async_training.staleness_threshold=1",
    "algorithm.rollout_correction.rollout_is=token",
    "trainer.total_steps=4",
]
OWN_KEYS = ("fully_async/",)  # the rollout ranks' own metrics
# Every process of every run with one thread, whatever the machine: runs compared bit for bit (a colocated run with
# rollout ranks, a replay with its dumps) then compute with the same kernels and summation orders.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def same(m: dict) -> dict:
    """The metrics that a run with the same seeds reproduces: all but the timings and the rollout ranks' own
    (waits, overlap)."""
    return {k: v for k, v in comparable(m).items() if not k.startswith(OWN_KEYS)}


def weights(out) -> dict:
    return load_file(os.path.join(out, "hf", "model.safetensors"))


@pytest.fixture(scope="module")
def colocated(tiny_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated")
    run_grpo(out, 2, env=ONE_THREAD)
    return out


@pytest.fixture(scope="module")
def synchronous(tiny_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("synchronous")
    run_grpo(out, 3, *RANKS, env=ONE_THREAD)
    return out


@pytest.fixture(scope="module")
def one_step_off(tiny_build, tmp_path_factory):
    """The k = 1 run, its batches dumped and a checkpoint kept at every step."""
    out = tmp_path_factory.mktemp("one_step_off")
    run_grpo(
        out,
        3,
        *ONE_STEP_OFF,
        f"trainer.dump_batches={out / 'dump'}",
        "trainer.save_every=1",
        "trainer.keep_checkpoints=4",
        env=ONE_THREAD,
    )
    return out


@pytest.fixture(scope="module")
def two_steps_off(tiny_build, tmp_path_factory):
    """The k = 2 run, 1 trainer rank and 1 rollout rank (batches 3 and 4 at the bound: sampled by the weights of steps
    0 and 1), dumped, a checkpoint kept at every step."""
    out = tmp_path_factory.mktemp("two_steps_off")
    run_grpo(
        out,
        2,
        *ONE_STEP_OFF,
        "async_training.staleness_threshold=2",
        f"trainer.dump_batches={out / 'dump'}",
        "trainer.save_every=1",
        "trainer.keep_checkpoints=4",
        "trainer.export_hf=false",
        env=ONE_THREAD,
    )
    return out


def test_at_staleness_0_the_run_is_the_colocated_one(colocated, synchronous):
    """Every metric but the timings, rollout/sync_check (a probe through an engine in the trainer's own process)
    and the rollout ranks' own equal the colocated run's, step by step; the exported weights are bit-identical."""
    mine, theirs = read_metrics(synchronous), read_metrics(colocated)
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [0, 1, 2, 3]
    for m, c in zip(mine, theirs, strict=True):
        c = {k: v for k, v in comparable(c).items() if k != "rollout/sync_check"}
        assert same(m) == c
        if m["step"]:
            assert m["fully_async/staleness"] == 0.0
    a, b = weights(synchronous), weights(colocated)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(os.path.join(model_dir(), "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in start)  # and they trained


def model_dir() -> str:
    import tiny

    return tiny.build(os.path.join(ROOT, ".cache", "tiny"), seed=0)["model"]


def policy(out, version: int):
    """HF's model (fp32) with the weights of step `version`: the tiny model at 0, else that step's checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(model_dir(), torch_dtype=torch.float32)
    if version:
        path = out / f"step_{version}.pt"
        if not path.exists():
            dcp_to_torch_save(out / "checkpoints" / f"step_{version}", path)
        missing, unexpected = model.load_state_dict(torch.load(path)["model"], strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    return model.eval()


def response_logprobs(model, dump: dict) -> torch.Tensor:
    """Each dumped row's sampled tokens' log-probs under model, one row at a time without padding: [tokens]."""
    width = dump["response_mask"].shape[1]
    out = []
    for ids, attention in zip(dump["input_ids"], dump["attention_mask"], strict=True):
        prompt = ids[:-width][attention[:-width].bool()]
        response = ids[-width:][attention[-width:].bool()]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1]
        out.append(torch.log_softmax(logits.double(), -1).gather(-1, response[:, None])[:, 0])
    return torch.cat(out)


def sampled(dump: dict, key: str) -> torch.Tensor:
    """dump[key] at every sampled token, in response_logprobs' order."""
    width = dump["response_mask"].shape[1]
    return dump[key][dump["attention_mask"][:, -width:].bool()].double()


@pytest.mark.parametrize(
    "run, k, step", [("one_step_off", 1, s) for s in (2, 3, 4)] + [("two_steps_off", 2, s) for s in (3, 4)]
)
def test_each_batch_is_sampled_by_the_weights_its_staleness_allows(request, run, k, step):
    """At k = 1 batch s (s >= 2) records policy version s - 2 in every sample; at k = 2 batches 3 and 4, at the
    bound (staleness 2), versions 0 and 1. vLLM's log-probs equal that policy's, computed in float64 by HF on
    the checkpoint of that step, at fp32 noise, and so do the trainer's log-probs under its kept weights
    (batch["sampler_logprobs"]); the old-log-prob pass equals the current policy's (the checkpoint of step s - 1),
    from which vLLM's differ far beyond the noise."""
    out = request.getfixturevalue(run)
    version = max(0, step - 1 - k)
    dump = torch.load(out / "dump" / f"step_{step}.pt")
    assert dump["policy_version"].tolist() == [float(version)] * len(dump["policy_version"])
    assert dump["staleness"].tolist() == [float(step - 1 - version)] * len(dump["staleness"])
    sampler, current = policy(out, version), policy(out, step - 1)

    def compute(dtype):
        models = {"sampler": sampler, "current": current}
        if dtype == torch.float64:
            models = {name: fp32_noise.float64_copy(m) for name, m in models.items()}
        return {name: response_logprobs(m, dump) for name, m in models.items()}

    ref, noise = fp32_noise.measure(compute)
    vllm = sampled(dump, "rollout_logprobs")
    fp32_noise.check(vllm, ref["sampler"], noise["sampler"], f"step {step}: vLLM's against the sampling policy")
    fp32_noise.check(sampled(dump, "sampler_logprobs"), ref["sampler"], noise["sampler"], f"step {step}: kept")
    fp32_noise.check(sampled(dump, "old_logprobs"), ref["current"], noise["current"], f"step {step}: old pass")
    assert (vllm - ref["current"]).abs().max() > 100 * fp32_noise.FACTOR * noise["current"]


def test_at_staleness_1_the_first_batch_is_sampled_by_the_start_and_the_metrics_say_so(one_step_off):
    """Batch 1: the weights of step 0 (staleness 0); later ones staleness 1, each within the bound; the trainer
    waits for none of them but the first (sampled after validation at step 0, while the trainers wait), and the sync
    proof rollout/logprob_diff_max (vLLM's against the sampling policy's) stays at fp32 noise, under the run's bound.
    fully_async/overlap is, at every step, the share of the batch's generation (the rollout rank's timing_s/gen and
    timing_s/reward) the trainer did not wait for (fully_async/total_wait_time): how large depends on the machine's
    load (bench/overlap.py measures it), the formula does not."""
    dump = torch.load(one_step_off / "dump" / "step_1.pt")
    assert set(dump["policy_version"].tolist()) == {0.0}
    steps = [m for m in read_metrics(one_step_off) if m["step"] >= 1]
    assert [m["fully_async/staleness"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    assert [m["fully_async/count/current_param_version"] for m in steps] == [0.0, 1.0, 2.0, 3.0]
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in steps)
    for m in steps:
        generation = m["timing_s/gen"] + m["timing_s/reward"]
        share = min(1.0, max(0.0, 1.0 - m["fully_async/total_wait_time"] / generation))
        assert m["fully_async/overlap"] == pytest.approx(share, rel=1e-6, abs=1e-9), m


def test_at_staleness_2_the_batches_reach_the_bound_and_each_is_proven(two_steps_off):
    """k = 2: batch 1 fresh, batch 2 one step stale, batches 3 and 4 at the bound (2); the sync proof
    rollout/logprob_diff_max (vLLM's against the kept weights that sampled each) at fp32 noise every step."""
    steps = [m for m in read_metrics(two_steps_off) if m["step"] >= 1]
    assert [m["fully_async/staleness"] for m in steps] == [0.0, 1.0, 2.0, 2.0]
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in steps)


@pytest.mark.parametrize("step", [2, 4])
def test_at_staleness_1_the_is_weights_and_advantages_are_the_formulas_on_the_batch(one_step_off, step):
    """rollout_is=token, threshold 2 (veRL's truncated IS): w = min(exp(old - vLLM's), 2) at every sampled token of
    the response mask; the advantages: each reward less its group's mean, over its std + 1e-6 (n = 8)."""
    dump = torch.load(one_step_off / "dump" / f"step_{step}.pt")
    mask = dump["response_mask"].bool()
    old, rollout = dump["old_logprobs"].double(), dump["rollout_logprobs"].double()
    expected = torch.exp(old - rollout).clamp(max=2.0)
    assert (expected[mask] != 1.0).any()  # stale: the weights are not all 1
    torch.testing.assert_close(dump["is_weights"][mask].double(), expected[mask], rtol=1e-6, atol=1e-7)
    rewards = dump["rewards"].double().view(-1, 8)  # [prompts, n]
    advantage = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    for row in range(dump["rewards"].shape[0]):
        got = dump["advantages"][row][mask[row]].double()
        torch.testing.assert_close(got, advantage.flatten()[row].expand_as(got), rtol=1e-6, atol=1e-6)


def test_at_staleness_1_the_update_is_the_replay_of_its_batches(one_step_off, tmp_path):
    """A colocated 2-rank replay of the dumped batches (no engine: the trainer's update on exactly those batches,
    which tests/test_loop.py checks against the formulas) ends at bit-identical weights, with the same update
    metrics at every step."""
    run_grpo(
        tmp_path,
        2,
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_steps=4",
        f"trainer.replay_batches={one_step_off / 'dump'}",
        env=ONE_THREAD,
    )
    a, b = weights(tmp_path), weights(one_step_off)
    assert all(torch.equal(a[k], b[k]) for k in a)
    replayed = {m["step"]: m for m in read_metrics(tmp_path)}
    for m in read_metrics(one_step_off)[1:]:
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm"):
            assert replayed[m["step"]][key] == m[key], (m["step"], key)


def test_two_rollout_ranks_in_bypass_mode_one_step_off(tmp_path):
    """veRL's one-step-off-policy recipe: bypass mode (vLLM's log-probs are pi_old), here with 2 rollout ranks for 2
    trainer ranks (4 processes) and two mini-batches in an fp32 run: it runs to the end, the sync proof at fp32 noise
    every step (vLLM's log-probs against the policy that sampled; the update's own forward of the first mini-batch
    at staleness 0), each batch as stale as the bound says, the dumped old log-probs vLLM's."""
    run_grpo(
        tmp_path,
        4,
        "rollout.n_gpus_per_node=2",
        "async_training.staleness_threshold=1",
        "algorithm.rollout_correction.bypass_mode=true",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        f"trainer.dump_batches={tmp_path / 'dump'}",
    )
    steps = read_metrics(tmp_path)
    assert [m["fully_async/staleness"] for m in steps] == [0.0, 1.0, 1.0]
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in steps)
    for step in (1, 2, 3):
        dump = torch.load(tmp_path / "dump" / f"step_{step}.pt")
        assert torch.equal(dump["old_logprobs"], dump["rollout_logprobs"])
        assert set(dump["policy_version"].tolist()) == {float(max(0, step - 2))}


def test_a_family_whose_engine_keeps_tensors_in_another_dtype_trains_with_rollout_ranks(tiny_tokenizer, tmp_path):
    """Apertus (vLLM builds its xIELU in bf16 in an fp32 engine, and its reload resets the activation's buffers beta
    and eps unless they are sent) with 1 trainer rank and 1 rollout rank, fp32, the weights moving every step: the
    trainers learn the engine's dtypes from the rollout rank and compute alike, the buffers travel after the weights,
    so the start-up proof and every push's pass (a mismatch stops the run in one line) and vLLM's log-probs are the
    trainer's at fp32 noise (~1e-6; the xIELU left in fp32 arithmetic is ~1e-4 off). Seen failing
    with the trainers not matched (the start-up proof names the bf16 tensors) and with the buffers not sent."""
    path = tiny.save_random_family_model(
        str(tmp_path / "apertus"),
        tiny_tokenizer,
        transformers.ApertusConfig,
        seed=1,
        tie_word_embeddings=False,
        max_position_embeddings=65536,
    )
    out = tmp_path / "run"
    run_grpo(
        out,
        2,
        *RANKS,
        f"model.path={path}",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        "actor.entropy_coeff=0.01",  # the weights move though a random model scores 0
        "actor.lr=1e-3",
        env=ONE_THREAD,
    )
    steps = read_metrics(out)
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["actor/grad_norm"] > 0
    diffs = [m["rollout/logprob_diff_max"] for m in steps]
    assert all(diff < 1e-5 for diff in diffs), diffs  # 9.5e-7 here


def test_a_stop_at_staleness_1_resumes_without_losing_or_repeating_a_batch(one_step_off, tmp_path):
    """SIGTERM to trainer rank 1 only during the run: every rank stops after the step with its checkpoint (the
    rollout rank, which sampled the next batch already, told by the trainers' stop vote: no error line);
    trainer.resume=auto continues.
    Each step's batch is generation batch s's prompts, as in the straight run: the one sampled ahead and lost is
    sampled again, by the resumed weights (staleness 0), and the steps before the stop are the straight run's."""
    out = tmp_path / "run"
    status, report, _ = signal_a_worker(out, [], ["trainer.save_every=0"], 1, 1, signal.SIGTERM)
    assert status != 0
    stopped = max(r["step"] for r in read_metrics(out))
    assert 1 <= stopped < 4 and f"stopped by SIGTERM after step {stopped}" in report, report[-3000:]
    assert not re.search(r"^error:|the trainer ranks ended the run", report, re.M), report[-3000:]
    run_grpo(out, 3, *ONE_STEP_OFF, f"trainer.dump_batches={out / 'dump'}", "trainer.resume=auto", env=ONE_THREAD)
    metrics, straight = read_metrics(out), read_metrics(one_step_off)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert [same(m) for m in metrics[: stopped + 1]] == [same(m) for m in straight[: stopped + 1]]
    staleness = [m["fully_async/staleness"] for m in metrics[1:]]
    assert staleness == [0.0, *[1.0] * (stopped - 1), 0.0, *[1.0] * (3 - stopped)]
    for step in range(1, 5):
        mine = torch.load(out / "dump" / f"step_{step}.pt")
        theirs = torch.load(one_step_off / "dump" / f"step_{step}.pt")
        assert prompts(mine) == prompts(theirs), step
        expected_version = step - 1 if step == stopped + 1 else max(0, step - 2)
        assert set(mine["policy_version"].tolist()) == {float(expected_version)}, step


GRACE = 60  # seconds from SIGTERM to SIGKILL, as a scheduler's grace period: here a step and a checkpoint take < 15


@pytest.mark.parametrize("trainers, rollouts, every, signalled", [(1, 1, 2, 1), (2, 2, 3, 2)])
def test_a_stop_signal_to_a_rollout_rank_stops_the_job_after_the_step(
    one_step_off, tmp_path, trainers, rollouts, every, signalled
):
    """SIGTERM to a rollout rank (1 + 1: the only one; 2 + 2: the first, job rank 2, whose acknowledgement trainer
    rank 0 reads before rank 3's, which carries no signal; the last is signalled in the last step:
    test_a_stop_to_the_last_of_two_rollout_ranks_in_the_last_step_ends_every_rank_after_it), SIGKILL if it still
    runs GRACE seconds later: it reports the signal with its acknowledgement of the weights, every rank ends after
    that step (the rollout ranks by themselves, none killed), the step's
    checkpoint the only one; trainer.resume=auto continues. Each step's batch is generation batch s's prompts (the
    straight run's), trained once, the one sampled ahead sampled again by the resumed weights; the sync proof on
    each fresh batch and every trainer.sync_check_every steps, not on the other stale ones (every = 2 and 3: whatever
    step the stop comes after, the two runs hold both a stale batch proven and one not). With 2 trainer ranks the
    steps before the stop are the straight 2 + 1 run's, metric for metric."""
    out, nproc = tmp_path / "run", trainers + rollouts
    options = [f"rollout.n_gpus_per_node={rollouts}", f"trainer.sync_check_every={every}"]
    status, report, killed = signal_a_worker(
        out, [], [*options, "trainer.save_every=0"], 1, signalled, signal.SIGTERM, nproc=nproc, grace=GRACE
    )
    stopped = max(r["step"] for r in read_metrics(out))
    assert not killed and status != 0, report[-3000:]
    assert 1 <= stopped < 4 and f"stopped by SIGTERM after step {stopped}" in report, report[-3000:]
    assert not re.search(r"^error:|the trainer ranks ended the run", report, re.M), report[-3000:]
    checkpoints = fsdp_train.list_checkpoints(str(out / "checkpoints"))
    assert [os.path.basename(c) for c in checkpoints] == [f"step_{stopped}"]
    run_grpo(
        out,
        nproc,
        *ONE_STEP_OFF,
        *options,
        f"trainer.dump_batches={out / 'dump'}",
        "trainer.resume=auto",
        env=ONE_THREAD,
    )
    metrics, straight = read_metrics(out), read_metrics(one_step_off)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    staleness = [m["fully_async/staleness"] for m in metrics[1:]]
    assert staleness == [0.0, *[1.0] * (stopped - 1), 0.0, *[1.0] * (3 - stopped)]
    for step in range(1, 5):
        mine = torch.load(out / "dump" / f"step_{step}.pt")
        assert prompts(mine) == prompts(torch.load(one_step_off / "dump" / f"step_{step}.pt")), step
        expected_version = step - 1 if step == stopped + 1 else max(0, step - 2)
        assert set(mine["policy_version"].tolist()) == {float(expected_version)}, step
    for m in metrics[1:]:
        fresh = m["fully_async/staleness"] == 0.0
        proven = fresh or m["step"] % every == 0
        assert ("rollout/logprob_diff_max" in m) == proven and ("timing_s/sampler_log_prob" in m) == (
            proven and not fresh
        )
        assert not proven or m["rollout/logprob_diff_max"] < 1e-3, m["step"]
    if trainers == 2:
        proof = ("rollout/logprob_diff_",)
        unproven = [{k: v for k, v in same(m).items() if not k.startswith(proof)} for m in metrics[: stopped + 1]]
        assert unproven == [
            {k: v for k, v in same(m).items() if not k.startswith(proof)} for m in straight[: stopped + 1]
        ]


def test_a_stop_to_the_last_of_two_rollout_ranks_in_the_last_step_ends_every_rank_after_it(tmp_path):
    """2 + 2 ranks at k = 1, 2 steps: SIGTERM to job rank 3, the LAST rollout rank (trainer rank 0 reads its
    acknowledgement of the weights after rank 2's, which carries no signal), once step 1 is logged: its
    acknowledgement of step 2's weights carries the signal, so the job stops after step 2, the last. Nothing was
    sampled ahead of the last step, so no rank waits for a batch: every rank ends by itself within GRACE (none
    killed), the trainer ranks with 128 + SIGTERM after the one line, the checkpoint of step 2 the only one, each
    step logged once, no error line. (The first rollout rank is signalled mid-run in
    test_a_stop_signal_to_a_rollout_rank_stops_the_job_after_the_step.)"""
    out = tmp_path / "run"
    options = ["rollout.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0"]
    status, report, killed = signal_a_worker(out, [], options, 1, 3, signal.SIGTERM, nproc=4, grace=GRACE)
    assert not killed, report[-3000:]
    assert status != 0 and "stopped by SIGTERM after step 2" in report, report[-3000:]
    assert not re.search(r"^error:|the trainer ranks ended the run", report, re.M), report[-3000:]
    exits = re.findall(r"exitcode\s*:\s*(-?\d+)", report)  # torchrun's summary of the failed workers
    assert exits and set(exits) <= {"143", "0"}, report[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    checkpoints = fsdp_train.list_checkpoints(str(out / "checkpoints"))
    assert [os.path.basename(c) for c in checkpoints] == ["step_2"]


def test_a_killed_rollout_rank_restarts_the_job_from_the_last_checkpoint(one_step_off, tmp_path):
    """SIGKILL to the rollout rank at k = 1 (torchrun --max-restarts 1, a checkpoint every step): the trainer ranks
    end on the broken link in one line, torchrun restarts every worker, and trainer.resume=auto continues from the
    last checkpoint; each step logged once, each step's batch generation batch s's prompts as in the straight run,
    the first one after the resume sampled by the resumed weights."""
    out = tmp_path / "run"
    options = ["trainer.save_every=1", "trainer.resume=auto"]
    status, report, _ = signal_a_worker(out, ["--max-restarts", "1"], options, 2, 2, signal.SIGKILL)
    assert status == 0
    resumed = int(re.search(r"resumed from \S+ \(step (\d+)\)", report).group(1))
    assert re.search(r"^error: .*(rollout|job) rank 2 .*(ended|is gone)", report, re.M), report[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert metrics[resumed + 1]["fully_async/staleness"] == 0.0
    for step in range(1, 5):
        mine = torch.load(out / "dump" / f"step_{step}.pt")
        assert prompts(mine) == prompts(torch.load(one_step_off / "dump" / f"step_{step}.pt")), step


def signal_a_worker(
    out, launcher_args: list, overrides: list, step: int, rank: int, signum, nproc: int = 3, grace: float | None = None
) -> tuple[int, str, bool]:
    """The k = 1 run (nproc processes, one thread each, dumping into out/dump; overrides may set the rollout ranks)
    under torchrun with launcher_args: once `step` is logged, signum to the worker of job rank `rank`, and, as a
    scheduler does, SIGKILL if it is still running `grace` seconds later. Returns torchrun's exit status, its
    output and whether the worker had to be killed."""
    args = [*SMALL, *ONE_STEP_OFF, f"trainer.output_dir={out}", f"trainer.dump_batches={out / 'dump'}", *overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *launcher_args]
    log_path = out.parent / "torchrun.log"
    killed = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*launcher, "--master_port", str(free_port()), "grpo.py", "--config", "tiny.yaml", *args],
            cwd=ROOT,
            env={**os.environ, **ONE_THREAD},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_step(out, step, proc)
            worker = worker_of_rank(proc.pid, rank)
            os.kill(worker, signum)
            if grace is not None:
                deadline = time.monotonic() + grace
                while running(worker) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if running(worker):
                    killed = True
                    os.kill(worker, signal.SIGKILL)
            status = proc.wait(timeout=600)
        finally:  # a rank that never learns of the stop waits in a collective: leave no run behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return status, log_path.read_text(), killed


def running(pid: int) -> bool:
    """Is process pid still running (neither gone nor a zombie that torchrun has yet to reap)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def prompts(dump: dict) -> list[tuple[int, ...]]:
    """The prompt of every dumped row, as token ids."""
    width = dump["response_mask"].shape[1]
    return [
        tuple(ids[:-width][a[:-width].bool()].tolist())
        for ids, a in zip(dump["input_ids"], dump["attention_mask"], strict=True)
    ]


def test_a_message_is_read_only_as_the_answer_it_names():
    """rollout_ranks.receive over a real gloo pair (job ranks 0 and 1 in this process, one thread each): a message
    is read when its kind, the rank it is for and its step or version are what the receiver waits for; a message
    that answers anything else (another step, kind or rank) stops with one line naming both."""
    import rollout_ranks

    store, groups = dist.HashStore(), [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    trainer, rollout = (types.SimpleNamespace(rank=rank, job=groups[rank]) for rank in (0, 1))

    def deliver(message: dict, kinds: tuple, **ids):
        sender = threading.Thread(target=rollout_ranks.send_object, args=(trainer.job, message, 1))
        sender.start()
        try:
            return rollout_ranks.receive(rollout, 0, kinds, **ids)
        finally:
            sender.join()

    batch = {"kind": "batch", "to": 1, "step": 3, "version": 2}
    assert deliver(batch, ("batch",), step=3) == batch
    wrong = {
        "another step": ({**batch, "step": 4}, "received kind batch, to 1, step 4"),
        "another kind": ({**batch, "kind": "validation"}, "received kind validation, to 1, step 3"),
        "another rank": ({**batch, "to": 0}, "received kind batch, to 0, step 3"),
        "no id": ((3, "batch"), "received kind (3, 'batch')"),
    }
    for name, (message, received) in wrong.items():
        with pytest.raises(rollout_ranks.RolloutRanksError) as error:
            deliver(message, ("batch",), step=3)
        line = str(error.value)
        assert line == f"job rank 1: expected batch, to 1, step 3 from job rank 0, {received}", (name, line)


def test_topologies_that_cannot_run_stop_with_one_line(tmp_path):
    """Before anything loads, torchrun's world (WORLD_SIZE) against the rollout ranks, and the settings they need."""
    base = ["--config", "tiny.yaml", "--print-config"]
    calls = {
        "more than the world": [*base, "rollout.n_gpus_per_node=2", "rollout.nnodes=2"],
        "no trainer": [*base, "rollout.n_gpus_per_node=3"],
        "more than trainers": [*base, "rollout.n_gpus_per_node=2"],
        "negative k": [*base, *RANKS, "async_training.staleness_threshold=-1"],
        "k without correction": [*base, *RANKS, "async_training.staleness_threshold=1"],
        "k without rollout ranks": [*base, "async_training.staleness_threshold=1"],
        "dynamic sampling": [*base, *RANKS, "algorithm.filter_groups.enable=true"],
        "routing replay": [*base, *RANKS, "actor.router_replay.mode=R2"],
        "bypass is enough": [
            *base,
            *RANKS,
            "async_training.staleness_threshold=1",
            "algorithm.rollout_correction.bypass_mode=true",
        ],
    }
    got = cli_calls(calls, tmp_path, env={"WORLD_SIZE": "3"})
    where = "config: rollout.nnodes x rollout.n_gpus_per_node = "
    expected = {
        "more than the world": f"{where}2 x 2 = 4 rollout ranks, more than the 3 rank(s) of the job",
        "no trainer": f"{where}1 x 3 = 3 rollout ranks in a job of 3 rank(s) leaves no trainer rank",
        "more than trainers": "= 2 rollout ranks for 1 trainer rank(s): each rollout rank serves whole trainer ranks",
        "negative k": "async_training.staleness_threshold",
        "k without correction": "async_training.staleness_threshold = 1 trains on samples of an older policy: set "
        "algorithm.rollout_correction.rollout_is",
        "k without rollout ranks": "async_training.staleness_threshold = 1 needs rollout ranks",
        "dynamic sampling": "config: algorithm.filter_groups.enable is not served by rollout ranks",
        "routing replay": "config: actor.router_replay.mode is not served by rollout ranks",
    }
    for name, text in expected.items():
        lines = got[name]["stderr"].strip().splitlines()
        assert got[name]["exit"] == 1 and len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], (
            name,
            got[name],
        )
    assert got["bypass is enough"]["exit"] == 0, got["bypass is enough"]

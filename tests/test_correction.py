"""Rollout correction, bypass mode and overlong shaping in the loop, end to end on the tiny model: a bf16
engine against the fp32 trainer is a real vLLM/trainer mismatch on this CPU. The math itself is tested
against independent implementations in tests/test_rollout_correction.py; here, the wiring: what the loop
computes over the whole batch of both ranks, what it dumps, and what a replay at another world size logs."""

import math

import pytest
import torch

import reward
from grpo_runs import read_metrics, run_grpo

N, BATCH, MAX_RESPONSE = 8, 8, 32  # grpo_runs.SMALL: 8 prompts x 8 samples of <= 32 tokens
RS_THRESHOLD = 1e-4  # token_k3 > 1e-4 (|log-ratio| > ~0.014 nats): a few per cent of the bf16 tokens here
CORRECTED = [
    "rollout.dtype=bfloat16",
    "algorithm.rollout_correction.rollout_is=sequence",
    "algorithm.rollout_correction.rollout_rs=token_k3",
    f"algorithm.rollout_correction.rollout_rs_threshold={RS_THRESHOLD}",
    "reward.overlong_buffer.enable=true",
    "reward.overlong_buffer.len=16",
    "reward.overlong_buffer.penalty_factor=0.5",
    "actor.ppo_mini_batch_size=8",
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.sync_check_every=0",
]


@pytest.fixture(scope="module")
def corrected(tiny_build, tmp_path_factory):
    """(folder, metrics) of a 2-rank run with a bf16 engine, sequence IS, token_k3 rejection and overlong shaping,
    dumping its batches; and the metrics of that dump replayed at 1 rank."""
    out = tmp_path_factory.mktemp("corrected")
    run_grpo(out / "run", 2, *CORRECTED, f"trainer.dump_batches={out / 'dump'}")
    replay = out / "replay"
    run_grpo(replay, 1, *CORRECTED, f"trainer.replay_batches={out / 'dump'}", "trainer.export_hf=false")
    return out, read_metrics(out / "run"), read_metrics(replay)


def test_a_correction_runs_the_old_pass_and_logs_the_mismatch(corrected):
    """One mini-batch and one epoch would let the update's own forward stand in for the old pass; a correction
    needs the old log-probs before the update, so the pass runs. bf16 vs fp32: a measurable mismatch."""
    out, rows, _ = corrected
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["timing_s/old_log_prob"] > 0
        assert 1e-4 < r["rollout/logprob_diff_mean"] < 1e-2 and r["rollout/logprob_diff_max"] > 0.01
        assert r["rollout_corr/k3_kl"] > 0  # exp(d) - d - 1 >= 0 per token, > 0 where the engine differs
        # chi2 is a sample estimate (mean of ratio^2, minus 1): its sign is the sample's (a CPU with AMX computes
        # bf16 closer to the trainer than one without, and gives a negative chi2_token). Its value, from the dump:
        d = torch.load(out / "dump" / f"step_{r['step']}.pt")
        width = d["response_mask"].shape[1]
        sampled = d["attention_mask"][:, -width:].double()  # [B, R]: every sampled token, before rejection
        delta = (d["old_logprobs"].double() - d["rollout_logprobs"].double()) * sampled  # [B, R]
        chi2_token = (torch.exp(2 * delta) * sampled).sum() / sampled.sum() - 1
        chi2_seq = torch.exp(2 * delta.sum(-1).clamp(-20, 20)).mean() - 1
        noise = 16 * torch.finfo(torch.float32).eps * torch.exp(2 * delta.abs().sum(-1)).max().item()  # fp32 roundings
        assert abs(r["rollout_corr/chi2_token"] - chi2_token.item()) <= noise
        assert abs(r["rollout_corr/chi2_seq"] - chi2_seq.item()) <= noise
        assert 0 < r["rollout_corr/rollout_rs_masked_fraction"] < 0.5
        assert 0 < r["rollout_corr/rollout_is_mean"] <= 2


def test_the_dump_holds_the_corrected_batch_computed_over_both_ranks(corrected, tiny_build):
    """From the dumped global batch, written out here from veRL's formulas: the sequence IS weights (product of
    the token ratios over every sampled token, capped at 2), the token_k3 rejection mask (holes included), the
    logged rejected fraction (over both ranks' tokens), the advantages over the surviving tokens only, and each
    reward = veRL's GSM8K score + DAPO's overlong penalty of its length. The reference's log-probs are taken
    before the rejection, as veRL's: at step 1 the reference IS the policy, so they are the old ones on every
    sampled token, the rejected ones included (the KL in the reward reads them there)."""
    import json

    from transformers import AutoTokenizer

    out, rows, _ = corrected
    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["train"]) as f:
        train = [json.loads(line) for line in f]
    holes = 0
    for step in (1, 2):
        d = torch.load(out / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        sampled = d["attention_mask"][:, -width:].double()  # [B, R]
        delta = (d["old_logprobs"].double() - d["rollout_logprobs"].double()) * sampled
        expected_w = torch.exp(delta.sum(-1).clamp(-20, 20)).clamp(max=2.0)[:, None] * sampled
        assert torch.allclose(d["is_weights"].double(), expected_w, rtol=1e-5, atol=0)
        x = d["old_logprobs"] - d["rollout_logprobs"]  # float32, as the loop computes it: the same boundary cases
        assert torch.equal(d["response_mask"].bool(), sampled.bool() & (torch.exp(x) - 1 - x <= RS_THRESHOLD))
        rejected = ((1 - d["response_mask"]) * sampled).sum() / sampled.sum()
        assert rows[step - 1]["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected.item(), rel=1e-6)
        lengths = sampled.sum(-1)
        last = (d["response_mask"] * torch.arange(width)).amax(-1)
        holes += int(((d["response_mask"].sum(-1) < last + 1) & (d["response_mask"].sum(-1) > 0)).sum())
        assert torch.equal(d["advantages"] != 0, (d["advantages"] != 0) & d["response_mask"].bool())
        if step == 1:
            assert torch.allclose(d["ref_logprobs"], d["old_logprobs"], rtol=0, atol=1e-5)
            assert (d["ref_logprobs"] * sampled.float()).ne(0).sum() == sampled.sum()  # no token left at 0
        for k in range(BATCH * N):
            text = tokenizer.decode(d["input_ids"][k, -width:][sampled[k].bool()], skip_special_tokens=True)
            truth = reward.extract_ground_truth(train[(step - 1) * BATCH + k // N]["answer"])
            over = max(0, int(lengths[k]) - (MAX_RESPONSE - 16))
            assert d["rewards"][k].item() == pytest.approx(
                reward.compute_score(text, truth) - over / 16 * 0.5, abs=1e-6
            )
    assert holes > 0  # rejection punched holes INSIDE responses, and the update took them


def test_a_replay_at_one_rank_logs_the_two_rank_runs_correction(corrected):
    """Whole-batch semantics: the 2-rank run's dump replayed at 1 rank gives exactly the correction metrics of the
    original run (the same global tensors at any world size), and the same update to rounding."""
    _, rows, replay = corrected
    for step in (1, 2):
        original = {k: v for k, v in rows[step - 1].items() if k.startswith("rollout_corr/")}
        assert len(original) >= 20
        assert {k: replay[step - 1][k] for k in original} == original
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/advantages/mean"):
            assert replay[step - 1][key] == pytest.approx(rows[step - 1][key], rel=1e-4, abs=1e-6), key


def test_bypass_mode_takes_vllms_log_probs_as_the_old_ones(tiny_build, tmp_path):
    """bypass_mode: no old-log-prob pass; the PPO ratio is taken against vLLM's log-probs (the dump's old ones ARE
    vLLM's), the diagnostics come from the update's own forward."""
    run_grpo(
        tmp_path / "run",
        1,
        "algorithm.rollout_correction.bypass_mode=true",
        "rollout.dtype=bfloat16",
        "algorithm.rollout_correction.rollout_rs=token_k3",
        f"algorithm.rollout_correction.rollout_rs_threshold={RS_THRESHOLD}",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        f"trainer.dump_batches={tmp_path / 'dump'}",
    )
    rows = read_metrics(tmp_path / "run")
    d = torch.load(tmp_path / "dump" / "step_1.pt")
    assert torch.equal(d["old_logprobs"], d["rollout_logprobs"])
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["timing_s/old_log_prob"] == 0.0 and r["rollout_corr/k3_kl"] > 0
        assert not math.isclose(r["actor/ppo_kl"], 0.0, abs_tol=1e-7)  # ratio pi / pi_vLLM: bf16 vs fp32

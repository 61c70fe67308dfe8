"""fsdp_train.py: exact global token-mean under FSDP2 (gloo), checkpoints, NaN skip, HF export."""

import copy
import math
import os

import pytest
import torch
from train_worker import CLIP, ENTROPY_COEF, KL_COEF, global_batch
from transformers import AutoModelForCausalLM

import fp32_noise
import fsdp_train as ft
import losses
from conftest import run_torchrun


# ------------------------------------------------------------------ pure helpers
def test_make_batch_layout_and_select_trims_padding():
    b = ft.make_batch([[5, 6], [7]], [[8], [9, 10]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 8, 0], [0, 7, 9, 10]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert b["response_mask"].tolist() == [[1, 0], [1, 1]]
    b["advantages"] = torch.tensor([[1.0, 0.0], [2.0, 2.0]])
    one = ft.select(b, [1])
    assert one["input_ids"].tolist() == [[7, 9, 10]] and one["advantages"].tolist() == [[2.0, 2.0]]
    zero = ft.select(b, [0])
    assert zero["input_ids"].tolist() == [[5, 6, 8]] and zero["response_mask"].tolist() == [[1.0]]


def test_micro_batches_respect_the_token_budget_and_cover_every_row():
    g = torch.Generator().manual_seed(0)
    prompts = [[1] * int(torch.randint(1, 30, (1,), generator=g)) for _ in range(40)]
    responses = [[2] * int(torch.randint(1, 60, (1,), generator=g)) for _ in range(40)]
    batch = ft.make_batch(prompts, responses, pad_id=0)
    groups = ft.micro_batches(batch, max_tokens=200)
    assert sorted(i for grp in groups for i in grp) == list(range(40))
    for grp in groups:  # the budget counts real tokens (veRL's dynamic batch size)
        assert len(grp) == 1 or sum(len(prompts[i]) + len(responses[i]) for i in grp) <= 200
    more = ft.micro_batches(batch, max_tokens=200, num_groups=len(groups) + 3)
    assert len(more) == len(groups) + 3 and sorted(i for grp in more for i in grp) == list(range(40))
    tiny = ft.micro_batches(ft.select(batch, [0, 1]), max_tokens=10_000, num_groups=4)
    assert sorted(map(len, tiny)) == [0, 0, 1, 1]  # empty groups keep the ranks' counts equal


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    lengths = [(2, 8), (30, 50), (5, 15), (3, 60), (1, 1), (4, 36)]  # (prompt, response): rows 1 and 3 exceed 40
    batch = ft.make_batch([[1] * p for p, _ in lengths], [[2] * r for _, r in lengths], pad_id=0)
    for budget in (40, 63):
        groups = ft.micro_batches(batch, max_tokens=budget)
        assert sorted(i for grp in groups for i in grp) == list(range(6)), budget  # every row, once
        for i, (p, r) in enumerate(lengths):
            if p + r > budget:
                assert [i] in groups, (budget, i)
        more = ft.micro_batches(batch, max_tokens=budget, num_groups=len(groups) + 2)
        assert sorted(i for grp in more for i in grp) == list(range(6))


def test_select_and_micro_batches_keep_real_tokens_that_the_response_mask_leaves_out():
    """Rejection sampling zeroes single tokens: a response's width comes from its real tokens (attention),
    not from response_mask.sum(), which would cut the response's last tokens off."""
    b = ft.make_batch([[5, 6], [7]], [[8, 9, 10, 11], [12, 13]], pad_id=0)
    b["response_mask"][0] = torch.tensor([1.0, 0.0, 1.0, 1.0])  # a hole at position 1 of a 4-token response
    b["response_mask"][1] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # the first token of a 2-token response
    b["advantages"] = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
    one = ft.select(b, [0])
    assert one["input_ids"].tolist() == [[5, 6, 8, 9, 10, 11]] and one["response_mask"].tolist() == [[1, 0, 1, 1]]
    assert one["advantages"].tolist() == [[1.0, 2.0, 3.0, 4.0]]
    two = ft.select(b, [1])
    assert two["input_ids"].tolist() == [[7, 12, 13]] and two["response_mask"].tolist() == [[0, 1]]
    both = ft.select(b, [1, 0])
    assert both["input_ids"].tolist() == [[0, 7, 12, 13, 0, 0], [5, 6, 8, 9, 10, 11]]
    groups = ft.micro_batches(b, max_tokens=8)  # 6 + 3 real tokens > 8, so one row each
    assert sorted(map(sorted, groups)) == [[0], [1]]


def test_list_checkpoints_ignores_a_tmp_directory_even_when_it_is_complete(tmp_path):
    """A crash between the COMPLETE marker and the rename leaves step_N.tmp/COMPLETE: not a checkpoint."""
    for name in ("step_1", "step_2.tmp", "step_10", "step_3"):
        os.makedirs(tmp_path / name)
    for name in ("step_1", "step_2.tmp", "step_10"):
        (tmp_path / name / "COMPLETE").write_text("1\n")
    # step_3 has no COMPLETE (crashed before the marker); steps sort by number, not by name
    assert [os.path.basename(p) for p in ft.list_checkpoints(str(tmp_path))] == ["step_1", "step_10"]
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "COMPLETE").write_text("2\n")
    assert [os.path.basename(p) for p in ft.list_checkpoints(str(tmp_path))] == ["step_1", "step_2", "step_10"]


def test_lr_schedules_are_verls():
    """verl/utils/torch_functional.py (0.9.1), worked by hand: warmup factor = step / W (the first update
    runs at lr 0); cosine after warmup = max(m, m + (1 - m) * (1 + cos(pi * (step - W) / (total - W))) / 2)."""
    model = torch.nn.Linear(2, 2)
    _, constant = ft.make_optimizer(model, lr=1.0, warmup_steps=2)
    _, cosine = ft.make_optimizer(model, lr=1.0, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.1)
    _, no_warmup = ft.make_optimizer(model, lr=1.0, total_steps=4, schedule="cosine")
    lrs = {"constant": [], "cosine": [], "no_warmup": []}
    for _ in range(7):
        for name, sched in (("constant", constant), ("cosine", cosine), ("no_warmup", no_warmup)):
            lrs[name].append(sched.get_last_lr()[0])  # the lr of the next optimizer step
            sched.step()
    assert lrs["constant"] == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    c = math.cos(math.pi / 4)  # step 3: progress 1/4
    assert lrs["cosine"] == pytest.approx([0.0, 0.5, 1.0, 0.1 + 0.9 * (1 + c) / 2, 0.55, 0.1 + 0.9 * (1 - c) / 2, 0.1])
    assert lrs["no_warmup"][:5] == pytest.approx([1.0, (1 + c) / 2, 0.5, (1 - c) / 2, 0.0])
    with pytest.raises(ValueError, match="constant, cosine"):
        ft.make_optimizer(model, lr=1.0, schedule="linear")


def test_mfu_matches_the_formula_by_hand():
    class C:  # a Qwen2.5-7B-like shape
        hidden_size, intermediate_size, num_hidden_layers = 3584, 18944, 28
        num_attention_heads, num_key_value_heads, vocab_size = 28, 4, 152064

    d = 128
    n = 28 * (3 * 3584 * 18944 + 3584 * (28 * d + 2 * 4 * d + 28 * d)) + 2 * 152064 * 3584
    assert n == pytest.approx(7.6e9, rel=0.02)  # ~7.6B parameters
    seqs = [300, 500]
    flops = 6 * n * 800 + 6 * (300**2 + 500**2) * d * 28 * 28
    assert ft.estimate_flops(C, seqs) == pytest.approx(flops)
    assert ft.estimate_flops(C, [300]) + ft.estimate_flops(C, [500]) == pytest.approx(flops)  # additive over ranks
    assert ft.mfu(flops, 2.0, 4, 989e12) == pytest.approx(flops / 2.0 / 989e12 / 4)
    assert ft.mfu(flops, 2.0, 4, 0.0) == 0.0


# ------------------------------------------------------------------ the exact update
# The reference is the plain run in float64; the bounds are fp32_noise.FACTOR x the fp32 noise measured at
# test time (tests/helpers/fp32_noise.py). Measured (2 x86 cores, AVX-512): noise of the weights after 3 steps
# 6e-7 (max |w - ref|: Adam turns the tiny, noisy gradient of a k_proj bias into a 1e-4 relative change), of
# the metrics 1 to 5 fp32 roundings of their value; the code's error / the noise at world sizes 1 and 2
# (2: 40-token budget, rows longer than it), recompute included: weights <= 0.92, pg_loss 0.95, grad_norm
# 1.68, entropy 0.24, kl_loss 0.62, ppo_kl 0.44, pg_clipfrac 0.10; export: trainer 0.96, vLLM 0.74.
METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac")


def reference_run(model, steps: int, lr: float = 1e-3) -> dict:
    """Plain PyTorch, one process, whole batch in one forward, in the model's dtype (float64: the reference;
    float32: measures the fp32 noise, tests/helpers/fp32_noise.py): what the distributed update must equal. The
    batch's inputs are made in fp32 as the worker makes them, then cast. Returns, for each step s,
    "weights@s" (all weights after it) and "<metric>@s"."""
    dtype = next(model.parameters()).dtype
    torch.manual_seed(0)
    optimizer, scheduler = ft.make_optimizer(model, lr=lr, warmup_steps=2, total_steps=6, schedule="cosine")
    out = {}
    for step in range(1, steps + 1):
        b = global_batch(step, model.config.vocab_size)
        b["advantages"] = b["advantages"] * (1 + 0.1 * torch.rand(1))
        b = {k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()}
        r = b["response_mask"].shape[1]
        pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits
        logits = logits[:, -r - 1 : -1].to(dtype)
        logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]
        mask = b["response_mask"]
        per_token, parts = losses.policy_loss(logp, b["old_logprobs"], b["advantages"], **CLIP)
        pg = losses.agg_loss(per_token, mask)
        m = {key: losses.masked_mean(part, mask).item() for key, part in parts.items()}
        ent = losses.agg_loss(losses.entropy_from_logits(logits), mask)
        kl = losses.agg_loss(losses.kl_penalty(logp, b["ref_logprobs"], "low_var_kl"), mask)
        optimizer.zero_grad()
        (pg - ENTROPY_COEF * ent + KL_COEF * kl).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        if step == 1:  # the gradients the optimizer takes (clipped), compared before AdamW transforms them
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}  # LoRA: its
            out["grads@1"] = fp32_noise.Flat(grads)  # adapters alone; the frozen base has no gradient
        optimizer.step()
        scheduler.step()
        metrics = {
            "actor/pg_loss": pg.item(),
            "actor/grad_norm": norm,
            "actor/entropy": ent.item(),
            "actor/kl_loss": kl.item(),
            "actor/ppo_kl": m["ppo_kl"],
            "actor/pg_clipfrac": m["pg_clipfrac"],
        }
        out.update({f"{k}@{step}": v for k, v in metrics.items()})
        out[f"weights@{step}"] = fp32_noise.Flat({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def reference(random_models):
    """(reference, noise): reference_run on the tied model for 3 steps in float64, and how far fp32 lands
    from it at 1 and 2 threads (tests/helpers/fp32_noise.py)."""
    model = AutoModelForCausalLM.from_pretrained(random_models["tied"], dtype=torch.float32)
    return fp32_noise.measure(
        lambda dtype: reference_run(
            fp32_noise.float64_copy(model) if dtype == torch.float64 else copy.deepcopy(model), steps=3
        )
    )


def check_run(weights: dict, history: list[dict], reference: tuple[dict, dict], what: str):
    """The worker's final weights and every step's metrics against the float64 reference, within FACTOR x
    the fp32 noise (tests/helpers/fp32_noise.py)."""
    ref, noise = reference
    steps = history[-1]["step"]
    fp32_noise.check(weights, ref[f"weights@{steps}"], noise[f"weights@{steps}"], f"{what} weights")
    for h in history:
        for key in METRICS:
            at = f"{key}@{h['step']}"
            fp32_noise.check(h[key], ref[at], noise[at], f"{what} {at}")


def flat_norm(named: dict) -> float:
    return torch.linalg.norm(fp32_noise.flat(named, named)).item()


def max_weight_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b if k in a)


def test_two_ranks_one_rank_and_plain_pytorch_agree_with_unequal_micro_batches(random_models, reference, tmp_path):
    """World sizes 1 and 2 equal the float64 plain run (the whole padded batch in one forward): step 1's gradients,
    every step's metrics, the final weights. At 2 ranks the token budget (40) is below the longest
    rows (41..47 tokens): each gets a micro-batch of its own, and its tokens are in the loss. Every batch has
    response-mask holes (train_worker.global_batch): masked real tokens that still condition later ones."""
    path = random_models["tied"]
    one = run_torchrun("train_worker.py", 1, path, str(tmp_path / "ws1"), "--steps", "3")
    two = run_torchrun("train_worker.py", 2, path, str(tmp_path / "ws2"), "--steps", "3", "--max-tokens", "40")
    assert two[0]["over_budget_rows"] > 0  # rows longer than the budget really were in the batches
    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert max_weight_diff(reference[0]["weights@3"], start) > 1e-3  # the steps really moved the weights
    check_run(torch.load(tmp_path / "ws1" / "final_ws1.pt"), one[0]["history"], reference, "world 1")
    check_run(torch.load(tmp_path / "ws2" / "final_ws2.pt"), two[0]["history"], reference, "world 2")
    assert two[0]["history"] == two[1]["history"]  # every rank reports the same global metrics
    ref, noise = reference
    for world in (1, 2):  # the packed micro-batches' gradients, before AdamW: the padded whole batch's in float64
        grads = torch.load(tmp_path / f"ws{world}" / f"grads_ws{world}.pt")
        assert set(grads) == set(ref["grads@1"]) and flat_norm(grads) > 0
        fp32_noise.check(grads, ref["grads@1"], noise["grads@1"], f"world {world} step 1 gradients")


def test_activation_checkpointing_and_bf16_compute(random_models, reference, tmp_path):
    path = random_models["tied"]
    ref = reference[0]
    ac = run_torchrun("train_worker.py", 2, path, str(tmp_path / "ac"), "--steps", "2", "--activation-checkpointing")
    check_run(torch.load(tmp_path / "ac" / "final_ws2.pt"), ac[0]["history"], reference, "recompute")  # same math
    bf = run_torchrun("train_worker.py", 2, path, str(tmp_path / "bf"), "--steps", "2", "--bf16")
    weights = torch.load(tmp_path / "bf" / "final_ws2.pt")
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights
    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    keys = [k for k in start if k in weights]
    d_bf = fp32_noise.flat(weights, keys) - fp32_noise.flat(start, keys)
    d_ref = fp32_noise.flat(ref["weights@2"], keys) - fp32_noise.flat(start, keys)
    # Not fp32 noise, and kept as they were written: bf16 keeps 8 significant bits (rounding 2^-9 = 0.2% per
    # operation), and Adam's first steps move each weight by about lr * sign(gradient), so an element whose
    # gradient is within bf16 rounding of 0 may move either way. The bounds say "the same update direction,
    # clearly not identical": measured here, cosine 0.975 and pg_loss within 4e-5 relative (the log-softmax
    # runs in fp32, token_logprobs), against the limits 0.8 and 5%, which leave room for other CPUs' bf16 kernels.
    cosine = torch.nn.functional.cosine_similarity(d_bf, d_ref, dim=0).item()
    assert 0.8 < cosine < 1 - 1e-6, cosine
    for h in bf[0]["history"]:
        assert h["actor/pg_loss"] == pytest.approx(ref[f"actor/pg_loss@{h['step']}"], rel=0.05, abs=1e-3)


# ------------------------------------------------------------------ checkpoints and failures
def test_kill_then_resume_gives_bitwise_identical_losses(random_models, tmp_path):
    path = random_models["tied"]
    straight = run_torchrun("train_worker.py", 2, path, str(tmp_path / "a"), "--steps", "4")[0]["history"]
    run_torchrun(
        "train_worker.py",
        2,
        path,
        str(tmp_path / "b"),
        "--steps",
        "4",
        "--save-at",
        "2",
        "--kill-after-save",
        killed=True,
    )
    assert [os.path.basename(p) for p in ft.list_checkpoints(str(tmp_path / "b" / "ckpt"))] == ["step_2"]
    resumed = run_torchrun("train_worker.py", 2, path, str(tmp_path / "b"), "--steps", "4", "--resume")[0]["history"]
    assert [h["step"] for h in resumed] == [3, 4]
    assert resumed == straight[2:]  # bitwise: every metric of steps 3 and 4
    # the same checkpoint (written by 2 ranks) loads at world size 1, weights bitwise equal
    run_torchrun("train_worker.py", 1, path, str(tmp_path / "b"), "--steps", "2", "--resume")
    saved = torch.load(tmp_path / "b" / "saved_step2.pt")
    loaded = torch.load(tmp_path / "b" / "loaded_ws1.pt")
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(random_models, tmp_path):
    path = random_models["untied"]
    out = tmp_path / "run"
    run_torchrun(
        "train_worker.py", 2, path, str(out), "--steps", "3", "--save-at", "1", "--crash-save-at", "2", killed=True
    )
    root = str(out / "ckpt")
    assert os.path.isdir(os.path.join(root, "step_2.tmp"))  # the crash happened during the second save
    assert [os.path.basename(p) for p in ft.list_checkpoints(root)] == ["step_1"]
    run_torchrun("train_worker.py", 2, path, str(out), "--steps", "1", "--resume")
    saved, loaded = torch.load(out / "saved_step1.pt"), torch.load(out / "loaded_ws2.pt")
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_nan_gradient_skips_the_step_and_leaves_weights_untouched(random_models, tmp_path):
    hist = run_torchrun("train_worker.py", 1, random_models["tied"], str(tmp_path), "--steps", "3", "--nan-at", "2")[0][
        "history"
    ]
    assert [h["actor/skipped_steps"] for h in hist] == [0.0, 1.0, 0.0]
    assert math.isnan(hist[1]["actor/grad_norm"]) and hist[1]["weights_unchanged"] == 1.0
    assert math.isfinite(hist[2]["actor/grad_norm"])


# ------------------------------------------------------------------ HF export
def test_export_hf_loads_in_transformers_and_vllm(random_models, tmp_path):
    """The exported model in transformers and in vLLM gives the trainer's log-probs: the trainer's (FSDP2,
    2 ranks, compute_logprobs) and vLLM's sampling log-probs against transformers' forward in float64 on the
    exported weights, within FACTOR x the fp32 noise of that forward (tests/helpers/fp32_noise.py)."""
    import rollout

    run_torchrun("train_worker.py", 2, random_models["tied"], str(tmp_path), "--steps", "1", "--export")
    hf_dir = str(tmp_path / "hf")
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert model.config.architectures == ["Qwen2ForCausalLM"] and model.config.tie_word_embeddings
    probe = torch.load(tmp_path / "probe.pt")
    b, r = probe["batch"], probe["batch"]["response_mask"].shape[1]
    llm = rollout.make_engine(hf_dir, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    samples = rollout.generate(
        llm, [[{"role": "user", "content": "Tom has 3 apples."}]], n=3, temperature=1.0, max_tokens=12, seed=0
    )
    del llm

    @torch.no_grad()
    def plain(dtype):  # transformers' forward: the probe's masked log-probs and each sample's
        m = fp32_noise.float64_copy(model) if dtype == torch.float64 else model
        pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits
        logp = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]
        out = {"probe": logp * b["response_mask"].to(dtype)}
        for i, s in enumerate(samples):
            lg = m(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
            out[f"sample{i}"] = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        return out

    ref, noise = fp32_noise.measure(plain)
    fp32_noise.check(probe["logprobs"][:, :r] * b["response_mask"], ref["probe"], noise["probe"], "trainer")
    for i, s in enumerate(samples):
        fp32_noise.check(torch.tensor(s.logprobs), ref[f"sample{i}"], noise[f"sample{i}"], f"vLLM sample {i}")


def test_the_trainers_peak_leaves_out_other_memory_pools():
    """perf/max_memory_allocated_gb on GPU: torch counts a sleeping vLLM's pool (a MemPool: segment_pool_id other
    than (0, 0)) as allocated; other_pools_bytes is what is subtracted. A snapshot in torch's format."""
    snapshot = [
        {"segment_pool_id": (0, 0), "allocated_size": 5 << 20},
        {"segment_pool_id": (1, 7), "allocated_size": 3 << 20},
        {"segment_pool_id": [1, 7], "allocated_size": 1 << 20},
        {"allocated_size": 2 << 20},
    ]
    assert ft.other_pools_bytes(snapshot) == 4 << 20

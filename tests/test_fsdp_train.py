"""fsdp_train.py: exact global token-mean under FSDP2 (gloo), checkpoints, NaN skip, HF export."""

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import fsdp_train as ft
import losses
from conftest import run_torchrun
from train_worker import CLIP, ENTROPY_COEF, KL_COEF, global_batch


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
    for grp in groups:
        width = max(len(prompts[i]) for i in grp) + max(len(responses[i]) for i in grp)
        assert len(grp) == 1 or len(grp) * width <= 200
    more = ft.micro_batches(batch, max_tokens=200, num_groups=len(groups) + 3)
    assert len(more) == len(groups) + 3 and sorted(i for grp in more for i in grp) == list(range(40))
    tiny = ft.micro_batches(ft.select(batch, [0, 1]), max_tokens=10_000, num_groups=4)
    assert sorted(map(len, tiny)) == [0, 0, 1, 1]  # empty groups keep the ranks' counts equal


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
def reference_run(model_path: str, steps: int, lr: float = 1e-3) -> tuple[dict, list[dict]]:
    """Plain PyTorch, one process, whole batch in one forward: what the distributed update must equal."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer, scheduler = ft.make_optimizer(model, lr=lr, warmup_steps=2, total_steps=6, schedule="cosine")
    history = []
    for step in range(1, steps + 1):
        b = global_batch(step, model.config.vocab_size)
        b["advantages"] = b["advantages"] * (1 + 0.1 * torch.rand(1))
        r = b["response_mask"].shape[1]
        pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits
        logits = logits[:, -r - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]
        mask = b["response_mask"]
        pg, _ = losses.policy_loss(logp, b["old_logprobs"], b["advantages"], mask, **CLIP)
        ent = losses.agg_loss(losses.entropy_from_logits(logits), mask)
        kl = losses.agg_loss(losses.kl_penalty(logp, b["ref_logprobs"], "low_var_kl"), mask)
        optimizer.zero_grad()
        (pg - ENTROPY_COEF * ent + KL_COEF * kl).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        scheduler.step()
        history.append({"actor/pg_loss": pg.item(), "actor/grad_norm": norm, "actor/entropy": ent.item()})
    return model.state_dict(), history


def max_weight_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b if k in a)


def test_two_ranks_one_rank_and_plain_pytorch_agree_with_unequal_micro_batches(random_models, tmp_path):
    path = random_models["tied"]
    ref_weights, ref_hist = reference_run(path, steps=3)
    one = run_torchrun("train_worker.py", 1, path, str(tmp_path / "ws1"), "--steps", "3")
    two = run_torchrun("train_worker.py", 2, path, str(tmp_path / "ws2"), "--steps", "3")
    w1 = torch.load(tmp_path / "ws1" / "final_ws1.pt")
    w2 = torch.load(tmp_path / "ws2" / "final_ws2.pt")
    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert max_weight_diff(ref_weights, start) > 1e-3  # the steps really moved the weights
    assert max_weight_diff(w1, ref_weights) <= 1e-5
    assert max_weight_diff(w2, ref_weights) <= 1e-5
    for hist in (one[0]["history"], two[0]["history"]):
        for mine, ref in zip(hist, ref_hist):
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert two[0]["history"] == two[1]["history"]  # every rank reports the same global metrics


def test_activation_checkpointing_and_bf16_compute(random_models, tmp_path):
    path = random_models["tied"]
    ref_weights, ref_hist = reference_run(path, steps=2)
    ac = run_torchrun("train_worker.py", 2, path, str(tmp_path / "ac"), "--steps", "2", "--activation-checkpointing")
    assert max_weight_diff(torch.load(tmp_path / "ac" / "final_ws2.pt"), ref_weights) <= 1e-5  # recompute: same math
    bf = run_torchrun("train_worker.py", 2, path, str(tmp_path / "bf"), "--steps", "2", "--bf16")
    weights = torch.load(tmp_path / "bf" / "final_ws2.pt")
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights
    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    keys = [k for k in start if k in weights]
    d_bf = torch.cat([(weights[k] - start[k]).flatten() for k in keys])
    d_ref = torch.cat([(ref_weights[k] - start[k]).flatten() for k in keys])
    cosine = torch.nn.functional.cosine_similarity(d_bf, d_ref, dim=0).item()
    assert 0.8 < cosine < 1 - 1e-6, cosine  # bf16 forward/backward: the same update direction, not identical
    for mine, ref in zip(bf[0]["history"], ref_hist):
        assert mine["actor/pg_loss"] == pytest.approx(ref["actor/pg_loss"], rel=0.05, abs=1e-3)
    assert [h["actor/pg_loss"] for h in ac[0]["history"]] == pytest.approx([h["actor/pg_loss"] for h in ref_hist], rel=1e-5)


# ------------------------------------------------------------------ checkpoints and failures
def test_kill_then_resume_gives_bitwise_identical_losses(random_models, tmp_path):
    path = random_models["tied"]
    straight = run_torchrun("train_worker.py", 2, path, str(tmp_path / "a"), "--steps", "4")[0]["history"]
    run_torchrun("train_worker.py", 2, path, str(tmp_path / "b"), "--steps", "4", "--save-at", "2",
                 "--kill-after-save", killed=True)
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
    run_torchrun("train_worker.py", 2, path, str(out), "--steps", "3", "--save-at", "1", "--crash-save-at", "2",
                 killed=True)
    root = str(out / "ckpt")
    assert os.path.isdir(os.path.join(root, "step_2.tmp"))  # the crash happened during the second save
    assert [os.path.basename(p) for p in ft.list_checkpoints(root)] == ["step_1"]
    run_torchrun("train_worker.py", 2, path, str(out), "--steps", "1", "--resume")
    saved, loaded = torch.load(out / "saved_step1.pt"), torch.load(out / "loaded_ws2.pt")
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_nan_gradient_skips_the_step_and_leaves_weights_untouched(random_models, tmp_path):
    hist = run_torchrun("train_worker.py", 1, random_models["tied"], str(tmp_path), "--steps", "3",
                        "--nan-at", "2")[0]["history"]
    assert [h["actor/skipped_steps"] for h in hist] == [0.0, 1.0, 0.0]
    assert math.isnan(hist[1]["actor/grad_norm"]) and hist[1]["weights_unchanged"] == 1.0
    assert math.isfinite(hist[2]["actor/grad_norm"])


# ------------------------------------------------------------------ HF export
def test_export_hf_loads_in_transformers_and_vllm(random_models, tmp_path):
    import rollout
    run_torchrun("train_worker.py", 2, random_models["tied"], str(tmp_path), "--steps", "1", "--export")
    hf_dir = str(tmp_path / "hf")
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert model.config.architectures == ["Qwen2ForCausalLM"] and model.config.tie_word_embeddings
    probe = torch.load(tmp_path / "probe.pt")
    b, r = probe["batch"], probe["batch"]["response_mask"].shape[1]
    with torch.no_grad():
        pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits
        logp = torch.log_softmax(logits[:, -r - 1:-1].float(), -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]
    assert ((logp - probe["logprobs"][:, :r]) * b["response_mask"]).abs().max() <= 1e-5
    llm = rollout.make_engine(hf_dir, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    for s in rollout.generate(llm, [[{"role": "user", "content": "Tom has 3 apples."}]], n=3, temperature=1.0,
                              max_tokens=12, seed=0):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lg = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        hf = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert (hf - torch.tensor(s.logprobs)).abs().max() <= 1e-4
    del llm

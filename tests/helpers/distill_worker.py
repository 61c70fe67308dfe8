"""torchrun worker for tests/test_distill.py: forward_kl_topk's update where the loop runs it.

    torchrun --nproc_per_node 2 tests/helpers/distill_worker.py MODEL_PATH --chunks 0 3

For each chunk size (actor.logprob_chunk_size), a fresh policy (fsdp_train.load_model: FSDP2 at 2 ranks) is updated
by the step's update part as grpo.choose_parts builds it with distillation on (distill's wrapper around
grpo.update_actor), on this rank's share of a global batch of 8 rows (4 per rank: long responses on rank 0, short
ones and an empty one on rank 1, holes in the response mask) carrying a teacher's top-K: 2 mini-batches, 2 PPO
epochs, a token budget that cuts each into several micro-batches, learning rate 0 (every optimizer step sees the
initial policy). The student's top-k then comes from the update's own forward (the decoder's tap, distill.tap).
Each rank reports the update's metrics, how many top-k values its forwards left unconsumed, how many
micro-batches each mini-batch had and whether the batch kept the field the update laid out for its forwards; rank 0
also the reference: veRL's distillation_ppo_loss (tests/helpers/verl_distillation.py) of each global mini-batch on a
plain transformers forward (float64, and its fp32 noise: fp32_noise.measure), its loss, metrics and gradient norm,
averaged over the 4 optimizer steps as update_actor averages them.
"""

import argparse
import inspect
import types

import torch
from transformers import AutoConfig

import config
import distill
import fp32_noise
import fsdp_train as ft
import grpo
import verl_distillation as verl
from reporting import report, shut_down

K, TEMPERATURE, CLAMP = 4, 0.7, -6.0
MINI_BATCH, EPOCHS, MAX_TOKENS = 4, 2, 16  # global prompts per mini-batch (2 per rank), PPO epochs, tokens per micro
SHOWN = ("loss", "loss_min", "loss_max", "student_mass", "student_mass_min", "student_mass_max", "teacher_mass",
         "teacher_mass_min", "teacher_mass_max", "overlap_ratio")  # fmt: skip


def global_batch(vocab: int) -> dict:
    """8 rows, one prompt each: rows 0-3 with responses of 9..14 tokens (rank 0's), rows 4-7 of 1..4 tokens and one
    empty (rank 1's); holes in the longer responses' masks; the teacher's top-K log-probs and ids at each response
    position (a random teacher's), 0 outside the mask."""
    g = torch.Generator().manual_seed(3)
    lengths = [9, 14, 11, 12, 3, 0, 1, 4]
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in lengths]  # fmt: skip
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    batch = ft.make_batch(prompts, responses, pad_id=0)
    for row, n in enumerate(lengths):
        if n >= 9:
            batch["response_mask"][row, [2, n // 2]] = 0.0
    mask = batch["response_mask"]
    teacher = torch.log_softmax(torch.randn(*mask.shape, vocab, generator=g) * 2, -1)
    top, ids = torch.topk(teacher, K, dim=-1)
    batch["teacher_logprobs"], batch["teacher_ids"] = top * mask[..., None], ids * mask[..., None].long()
    batch["uid"] = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # each rank's prompts 0..3
    return batch


def settings(chunk: int) -> dict:
    overrides = [
        f"rollout.temperature={TEMPERATURE}",
        f"actor.ppo_mini_batch_size={MINI_BATCH}",
        f"actor.ppo_epochs={EPOCHS}",
        f"actor.ppo_max_token_len_per_gpu={MAX_TOKENS}",
        f"actor.logprob_chunk_size={chunk}",
        "actor.use_kl_loss=false",
        "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.model_path=teacher",  # not loaded: the batch has its top-K
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        f"distillation.distillation_loss.topk={K}",
        f"distillation.distillation_loss.log_prob_min_clamp={CLAMP}",
        "distillation.distillation_loss.use_task_rewards=false",
    ]
    return config.load_config(None, overrides)


def update(model_path: str, chunk: int, rank: int, world: int, batch: dict) -> dict:
    """The loop's update (parts.update: distill's around grpo.update_actor) of a fresh policy on this rank's rows."""
    _, _, device = ft.init_distributed()
    cfg = settings(chunk)
    parts = grpo.choose_parts(cfg)
    policy = ft.load_model(model_path, device=device)
    optimizer, scheduler = ft.make_optimizer(policy, lr=0.0)
    run = types.SimpleNamespace(
        cfg=cfg,
        world=world,
        parts=parts,
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        capture=False,
        model=types.SimpleNamespace(flops=ft.estimate_flops),
        peak_flops=0.0,
    )
    mine = ft.select(batch, [4 * rank + i for i in range(4)])  # 2 ranks: rank 0 rows 0-3, rank 1 rows 4-7
    out = parts.update(run, mine, {})
    student = inspect.getclosurevars(parts.loss).nonlocals["student"]  # the forwards' top-k, for the loss
    micro = [len(ft._synced_micro_batches(ft.select(mine, rows), MAX_TOKENS)) for rows in ([0, 1], [2, 3])]
    kept = distill.IDS in mine or distill.IDS in mine["layouts"]  # the teacher's ids laid out for the forwards
    return {"metrics": out, "left": len(student), "micro_batches": micro, "field_kept": kept}


def reference(model_path: str, batch: dict) -> tuple[dict, dict]:
    """veRL's loss of each global mini-batch (rows of prompts 0-1, then 2-3, of both ranks) on a plain transformers
    forward, averaged over the update's 4 optimizer steps (2 epochs): its metrics and the gradient's norm; in
    float64, with the fp32 noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    models = {torch.float32: model, torch.float64: fp32_noise.float64_copy(model)}
    distillation = verl.Config(
        distillation_loss=verl.Config(
            loss_mode="forward_kl_topk", topk=K, use_task_rewards=False, distillation_loss_coef=1.0,
            loss_max_clamp=None, log_prob_min_clamp=CLAMP, use_policy_gradient=False, policy_loss_mode="vanilla",
            clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, global_batch_info={},
        )
    )  # fmt: skip
    actor = verl.Config(loss_agg_mode="token-mean", global_batch_info={}, loss_scale_factor=None)

    def compute(dtype):
        out = {}
        for rows in ([0, 1, 4, 5], [2, 3, 6, 7]):
            b = ft.select(batch, rows)
            net = models[dtype]
            net.zero_grad(set_to_none=True)
            attention, width = b["attention_mask"], b["response_mask"].shape[1]
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = net(input_ids=b["input_ids"], attention_mask=attention, position_ids=positions).logits
            student = logits[:, -width - 1 : -1] / TEMPERATURE  # [b, R, V]
            n = student.shape[0] * width
            topk = verl.fsdp_compute_forward_kl_topk(
                student.reshape(1, n, -1),
                b["teacher_logprobs"].to(dtype).reshape(1, n, K),
                b["teacher_ids"].reshape(1, n, K),
                distillation,
            )
            data = {"response_mask": b["response_mask"].to(dtype), "teacher_logprobs": b["teacher_logprobs"],
                    "teacher_ids": b["teacher_ids"], "dp_size": 1, "batch_num_tokens": b["response_mask"].sum(),
                    "global_batch_size": len(rows)}  # fmt: skip
            output = {key: value.reshape(-1, width) for key, value in topk.items()}
            loss, metrics = verl.distillation_ppo_loss(actor, distillation, output, data)
            loss.backward()
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in net.parameters() if p.grad is not None))
            values = {k.removeprefix("distillation/"): verl.metric_value(v) for k, v in metrics.items()}
            for key in SHOWN:
                out[key] = out.get(key, 0.0) + values[key] / 2  # the mean over the mini-batches (and the epochs)
            out["grad_norm"] = out.get("grad_norm", 0.0) + norm.item() / 2
        return out

    return fp32_noise.measure(compute)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_path")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 3])
    args = ap.parse_args()
    rank, world, _ = ft.init_distributed()
    assert world == 2, "the rows are split over 2 ranks"
    batch = global_batch(AutoConfig.from_pretrained(args.model_path).vocab_size)
    result = {str(chunk): update(args.model_path, chunk, rank, world, batch) for chunk in args.chunks}
    if rank == 0:
        ref, noise = reference(args.model_path, batch)
        result["reference"], result["noise"] = ref, noise
    report(rank, result)
    shut_down()


if __name__ == "__main__":
    main()

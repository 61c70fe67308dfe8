"""torchrun worker for tests/test_fsdp_train.py.

    torchrun --nproc_per_node N tests/helpers/train_worker.py MODEL_PATH OUT_DIR --steps 3
                                                      [--save-at 2 --kill-after-save]
                                                      [--resume] [--nan-at 2] [--crash-save-at 2] [--export]
                                                      [--lora 4]

Every step trains on a synthetic GRPO mini-batch that is identical whatever the world size (seeded by
the step): 8 sequences whose response lengths differ wildly, split across ranks so that rank 0 holds
most of the tokens. Each rank reports the metrics of every step (tests/helpers/reporting.py), and how many of
its rows were longer than --max-tokens (they get a micro-batch of their own). --lora R trains LoRA adapters
(lora_settings) instead of the whole model, and reports lora_checks before training (step0) and after (trained):
whether the policy's and its adapters-off reference's log-probs equal the base model's bit for bit, and their KL.
"""

import argparse
import functools
import os
import signal

import torch
import torch.distributed as dist

import fsdp_train as ft
import lora
import losses
from reporting import report, shut_down

CLIP = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)
ENTROPY_COEF, KL_COEF = 0.003, 0.001


def lora_settings(rank: int) -> dict:
    """lora.loader's settings for --lora R: alpha 2R (scaling 2), every linear layer, adapters drawn from seed 0."""
    return {"rank": rank, "alpha": 2 * rank, "target_modules": "all-linear", "seed": 0}


def global_batch(step: int, vocab: int) -> dict:
    """8 sequences: 6 long (responses of 20..40 tokens) then 2 short (1..3 tokens). Every response of 3 tokens
    or more has HOLES: real tokens (attention 1) whose response_mask is 0, as rejection sampling leaves them
    (at response positions 1 and len // 2): they carry no loss but still condition the later tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    prompts, responses = [], []
    for i in range(8):
        p_len = int(torch.randint(3, 12, (1,), generator=g))
        r_len = int(torch.randint(20, 41, (1,), generator=g)) if i < 6 else int(torch.randint(1, 4, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (p_len,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (r_len,), generator=g).tolist())
    batch = ft.make_batch(prompts, responses, pad_id=0)
    for i, r in enumerate(responses):
        if len(r) >= 3:
            batch["response_mask"][i, [1, len(r) // 2]] = 0.0
    shape = batch["response_mask"].shape
    batch["old_logprobs"] = -torch.rand(shape, generator=g) * 6 - 4.0  # far from the model: ratios get clipped
    batch["ref_logprobs"] = -torch.rand(shape, generator=g) * 6 - 4.0
    batch["advantages"] = (torch.randn(8, generator=g)[:, None] * torch.ones(shape)) * batch["response_mask"]
    return batch


def rows_of_rank(rank: int, world: int) -> list[int]:
    if world == 1:
        return list(range(8))
    return [0, 1, 2, 3, 4, 5] if rank == 0 else [6, 7]  # very unequal token counts


def grpo_loss(logp, entropy, mb, counts, nan_hook=False):
    mask = mb["response_mask"]
    n = counts["num_tokens"]
    per_token, parts = losses.policy_loss(logp, mb["old_logprobs"], mb["advantages"], **CLIP)
    pg = losses.agg_loss(per_token, mask, num_tokens=n)
    m = {key: losses.masked_mean(part, mask).item() for key, part in parts.items()}
    ent = losses.agg_loss(entropy, mask, num_tokens=n)
    kl = losses.agg_loss(losses.kl_penalty(logp, mb["ref_logprobs"], "low_var_kl"), mask, num_tokens=n)
    if nan_hook and mask.sum() > 0:
        logp.register_hook(lambda g: torch.where(torch.arange(g.numel()).reshape(g.shape) == 0, float("nan"), g))
    share = mask.sum().item() / n
    return pg - ENTROPY_COEF * ent + KL_COEF * kl, {
        "actor/pg_loss": pg.item(),
        "actor/entropy": ent.item(),
        "actor/kl_loss": kl.item(),
        "actor/pg_clipfrac": m["pg_clipfrac"] * share,
        "actor/ppo_kl": m["ppo_kl"] * share,
    }


def full_weights(model) -> dict:
    return {
        k: v.clone()
        for k, v in ft.get_model_state_dict(
            model, options=ft.StateDictOptions(full_state_dict=True, cpu_offload=True)
        ).items()
    }


def full_grads(model) -> dict:
    """Every trainable parameter's gradient as a full tensor on the CPU (FSDP2's are sharded DTensors; a collective:
    every rank calls it)."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def lora_checks(path: str, model, rank: int, world: int, device) -> dict:
    """On a probe: does the LoRA model (adapters on) give the base model's log-probs bit for bit (the base loaded
    without LoRA), does its reference (the same model, adapters off) give them, and the low_var_kl between the two."""
    probe = ft.select(global_batch(98, model.config.vocab_size), rows_of_rank(rank, world))
    policy, _ = ft.compute_logprobs(model, probe, temperature=1.0, max_tokens=64)
    with lora.adapters_off(model):
        ref, _ = ft.compute_logprobs(model, probe, temperature=1.0, max_tokens=64)
    base, _ = ft.compute_logprobs(ft.load_model(path, device=device), probe, temperature=1.0, max_tokens=64)
    kl = losses.kl_penalty(policy, ref, "low_var_kl") * probe["response_mask"]
    return {
        "policy_equals_base": torch.equal(policy, base),
        "reference_equals_base": torch.equal(ref, base),
        "kl_max": kl.abs().max().item(),
        "tokens": int(probe["response_mask"].sum()),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--kill-after-save", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--nan-at", type=int, default=0)
    ap.add_argument("--crash-save-at", type=int, default=0)
    ap.add_argument("--export", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    args = ap.parse_args()

    rank, world, device = ft.init_distributed()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    built = {}  # LoRA's: its settings
    load = lora.loader(lora_settings(args.lora), built) if args.lora else ft.load_model
    model = load(
        args.model,
        device=device,
        activation_checkpointing=args.activation_checkpointing,
        compute_dtype=torch.bfloat16 if args.bf16 else None,
    )
    ft.check_logits_fn(model)
    step0 = {"step0": lora_checks(args.model, model, rank, world, device)} if args.lora and not args.resume else {}
    optimizer, scheduler = ft.make_optimizer(model, lr=args.lr, warmup_steps=2, total_steps=6, schedule="cosine")
    ckpt_root = os.path.join(args.out, "ckpt")
    start = 1
    if args.resume:
        extra = ft.load_checkpoint(ft.list_checkpoints(ckpt_root)[-1], model, optimizer, scheduler)
        start = extra["step"] + 1
        if extra["saved_world_size"] == world:
            torch.set_rng_state(extra["rng"])
        if rank == 0:
            torch.save(full_weights(model), os.path.join(args.out, f"loaded_ws{world}.pt"))
        else:
            full_weights(model)
    grads = {}  # step 1's gradients (clipped, as the optimizer takes them), full tensors: the packed path's

    def keep_first_grads(*_) -> None:
        if not grads:
            grads.update(full_grads(model))

    optimizer.register_step_pre_hook(keep_first_grads)
    history, over_budget = [], 0
    for step in range(start, args.steps + 1):
        batch = global_batch(step, model.config.vocab_size)
        batch["advantages"] = batch["advantages"] * (1 + 0.1 * torch.rand(1))  # uses the global RNG
        mine = ft.select(batch, rows_of_rank(rank, world))
        over_budget += int((mine["attention_mask"].sum(-1) > args.max_tokens).sum())  # rows that need a group alone
        nan_hook = step == args.nan_at
        before = full_weights(model) if nan_hook else None
        metrics = ft.train_step(
            model,
            optimizer,
            mine,
            functools.partial(grpo_loss, nan_hook=nan_hook),
            temperature=1.0,
            max_tokens=args.max_tokens,
            grad_clip=1.0,
            entropy_fn=losses.entropy_from_logits,
        )
        scheduler.step()
        if before is not None:
            after = full_weights(model)
            metrics["weights_unchanged"] = float(all(torch.equal(before[k], after[k]) for k in before))
        history.append({"step": step, **metrics})
        if step == 1 and rank == 0:
            torch.save(grads, os.path.join(args.out, f"grads_ws{world}.pt"))
        if step == args.crash_save_at:
            ft.torch.save = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # dies mid-save, after DCP shards
        if step in (args.save_at, args.crash_save_at):
            ft.save_checkpoint(
                ckpt_root, step, model, optimizer, scheduler, extra={"step": step, "rng": torch.get_rng_state()}
            )
            weights = full_weights(model)
            if rank == 0:
                torch.save(weights, os.path.join(args.out, f"saved_step{step}.pt"))
            if args.kill_after_save:
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
    if args.export:
        from transformers import AutoTokenizer

        tokenizer, out = AutoTokenizer.from_pretrained(args.model), os.path.join(args.out, "hf")
        if args.lora:  # the merged model and hf/lora_adapter, as grpo.finish exports
            lora.export(model, out, tokenizer, built["settings"])
        else:
            ft.export_hf(model, out, tokenizer)
        probe = global_batch(99, model.config.vocab_size)
        logp, _ = ft.compute_logprobs(
            model, ft.select(probe, rows_of_rank(rank, world)), temperature=1.0, max_tokens=64
        )
        if rank == 0:
            torch.save(
                {"batch": ft.select(probe, rows_of_rank(0, world)), "logprobs": logp},
                os.path.join(args.out, "probe.pt"),
            )
    weights = full_weights(model)
    if rank == 0:
        torch.save(weights, os.path.join(args.out, f"final_ws{world}.pt"))
    if args.lora:
        step0["trained"] = lora_checks(args.model, model, rank, world, device)
    report(rank, {"history": history, "over_budget_rows": over_budget, **step0})
    shut_down()


if __name__ == "__main__":
    main()

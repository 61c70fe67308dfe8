"""Train-step throughput: fsdp_train.train_step (FSDP2, world size 1, GRPO loss, global token-mean)
against a bare PyTorch forward + backward + AdamW loop over the SAME micro-batches in the same
process; and the share of padded tokens with and without token-budget micro-batching.

    .venv/bin/python bench/train_bench.py                   # tiny and Qwen2.5-0.5B-shaped models
    .venv/bin/python bench/train_bench.py --only tiny

Target: ratio (train_step tokens/s / bare tokens/s) >= 0.9. Runs the two alternately (A B A B ...)
after a warm-up, so machine drift hits both.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import fsdp_train as ft  # noqa: E402
import losses  # noqa: E402
import tiny  # noqa: E402


def gsm8k_like_lengths(n: int, rng: random.Random, scale: float = 1.0) -> list[tuple[int, int]]:
    """(prompt, response) lengths shaped like veRL's GSM8K report: prompts ~93 tokens (55..173),
    responses ~232 tokens, long-tailed (65..1024)."""
    out = []
    for _ in range(n):
        p = min(173, max(55, int(rng.gauss(93, 20))))
        r = min(1024, max(65, int(rng.lognormvariate(5.35, 0.45))))
        out.append((max(1, int(p * scale)), max(1, int(r * scale))))
    return out


def make_grpo_batch(lengths, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in lengths]
    b = ft.make_batch(prompts, responses, pad_id=0)
    b["old_logprobs"] = -torch.rand(b["response_mask"].shape, generator=g) * 3
    b["advantages"] = torch.randn(len(lengths), 1, generator=g) * b["response_mask"]
    return b


def grpo_loss(logp, entropy, mb, counts):
    per_token, _ = losses.policy_loss(logp, mb["old_logprobs"], mb["advantages"], clip_high=0.28)
    pg = losses.agg_loss(per_token, mb["response_mask"], num_tokens=counts["num_tokens"])
    return pg, {"actor/pg_loss": pg.item()}


def bare_step(model, optimizer, batch, groups):
    """The baseline: the same micro-batches, plain HF forward, log-softmax gather, backward, AdamW."""
    n_tokens = batch["response_mask"].sum()
    optimizer.zero_grad(set_to_none=True)
    for rows in groups:
        mb = ft.select(batch, rows)
        r = mb["response_mask"].shape[1]
        logits = model(
            input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False, logits_to_keep=r + 1
        ).logits  # the lm_head on the response positions only, as ours
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb["input_ids"][:, -r:, None])[..., 0]
        loss = -(logp * mb["advantages"] * mb["response_mask"]).sum() / n_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def throughput(name: str, path: str, lengths, max_tokens: int, rounds: int) -> None:
    rank, world, device = ft.init_distributed()
    batch = make_grpo_batch(lengths, vocab=AutoModelForCausalLM.from_pretrained(path).config.vocab_size)
    tokens = int(batch["attention_mask"].sum())
    groups = ft.micro_batches(batch, max_tokens)
    bare = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-6)
    ours = ft.load_model(path, device=device)
    ours_opt, _ = ft.make_optimizer(ours, lr=1e-6)
    run = {
        "bare PyTorch": lambda: bare_step(bare, bare_opt, batch, groups),
        "fsdp_train.train_step": lambda: ft.train_step(
            ours, ours_opt, batch, grpo_loss, temperature=1.0, max_tokens=max_tokens
        ),
    }
    times = {k: [] for k in run}
    for i in range(rounds + 1):  # round 0 is the warm-up
        for k, fn in run.items():
            t0 = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - t0)
    print(f"{name}: {len(lengths)} sequences, {tokens} tokens, {len(groups)} micro-batches of <= {max_tokens} tokens")
    for k, ts in times.items():
        print(f"  {k:<24} median {statistics.median(ts):7.3f} s/step  {tokens / statistics.median(ts):9.0f} tokens/s")
    ratio = statistics.median(times["bare PyTorch"]) / statistics.median(times["fsdp_train.train_step"])
    print(f"  ratio train_step / bare (tokens/s): {ratio:.3f}  (target >= 0.9)")


def padding_share() -> None:
    rng = random.Random(0)
    lengths = gsm8k_like_lengths(768, rng)  # one veRL step: 96 prompts x 8 on one GPU
    batch = ft.make_batch([[1] * p for p, _ in lengths], [[2] * r for _, r in lengths], pad_id=0)
    real = sum(p + r for p, r in lengths)

    def share(groups):
        padded = sum(len(g) * (max(lengths[i][0] for i in g) + max(lengths[i][1] for i in g)) for g in groups if g)
        return 1 - real / padded

    whole = 1 - real / (len(lengths) * (max(p for p, _ in lengths) + max(r for _, r in lengths)))
    fixed = share([list(range(i, i + 8)) for i in range(0, len(lengths), 8)])
    budget = share(ft.micro_batches(batch, 16384))
    print("padding share on a GSM8K-like step (768 sequences, prompts ~93, responses ~232 tokens):")
    print(f"  whole batch padded to its longest prompt + response   {whole:6.1%}")
    print(f"  fixed micro-batches of 8 rows, arrival order          {fixed:6.1%}")
    print(f"  token budget 16384, rows grouped by length, padded    {budget:6.1%}")
    print(f"  the same groups packed (ours: model.use_remove_padding) {0:6.1%}  (bench/packing.py)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["tiny", "0.5b", "padding"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.only in (None, "padding"):
        padding_share()
    tok = tiny.build_tokenizer([r["question"] for r in tiny.make_dataset(0, 400, 10)["train"]])
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "tiny"):
            lengths = gsm8k_like_lengths(64, random.Random(1), scale=0.25)
            throughput(
                "tiny (1.0M params)", tiny.save_random_model(os.path.join(tmp, "tiny"), tok), lengths, 4096, args.rounds
            )
        if args.only in (None, "0.5b"):
            lengths = gsm8k_like_lengths(4, random.Random(2), scale=0.5)
            path = tiny.save_random_model(os.path.join(tmp, "q05b"), tok, **tiny.QWEN25_05B)
            throughput("Qwen2.5-0.5B shape (494M params)", path, lengths, 512, max(2, args.rounds // 2))


if __name__ == "__main__":
    main()

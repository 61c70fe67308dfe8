"""On-policy distillation's memory (distill.py): the update's forward_kl_topk at Qwen2.5's vocabulary (V = 151,936, k =
32) against the plain GRPO update, and the teacher's pass as flatgrpo runs it (an FSDP2 model without gradients,
packed, chunked: fsdp_train.compute_logprobs) against a vLLM engine in prefill mode (veRL's teacher: prompt_logprobs),
measured at a small shape; then the arithmetic at the 0.5B student / 7B teacher shape.

    .venv/bin/python bench/distill_memory.py                    # all three parts (~10 min on 2 cores)
    .venv/bin/python bench/distill_memory.py --only update      # or teacher, or arithmetic

update:  the loop's update (the step's update part, grpo.choose_parts': grpo.update_actor, with distillation
         distill's around it) of one mini-batch in one micro-batch per point, each in a FRESH process (AdamW's
         states allocated first by a warm-up update), of ROWS x (100 prompt + 512 response) tokens of a model with
         Qwen2.5-0.5B's width and vocabulary and 2 layers (the head's share of the memory is the 0.5B model's; fewer
         layers only lower what the body adds): the plain update (the GRPO loss, chunked log-probs,
         actor.logprob_chunk_size 512), forward_kl_topk (the teacher's top-32 in the batch, the student's top-k in
         the same forward: distill's tap of the policy's decoder, chunked as the log-probs), and forward_kl_topk with
         chunking off (chunk 0: [tokens, V] logits held for the backward, what the chunked path avoids). Printed:
         the peak above the resident model and states, and the marginal MB per micro-batch token between the two
         row counts (what a [tokens, V] fp32 tensor would add: 0.61 MB per token).
teacher: one teacher pass per point in a fresh process over the same rows, the model of the update part as the
         teacher: the advantages part's teacher pass (distill.teacher_part: fsdp_train.compute_logprobs, with the
         teacher's decoder tapped for the top-k) of the sampled tokens (the k1..k3 modes), with the top-32
         (forward_kl_topk), and a vLLM engine's prefill with prompt_logprobs=32 (max_tokens 1, as veRL's teacher
         asks it; rollout.make_engine, VLLM_CPU_KVCACHE_SPACE=1); peak above what was resident before the pass, and
         per token.
         CPU: the process's resident high-water mark (bench/memory.py's measure); GPU: max_memory_allocated.
arithmetic: the per-GPU memory of each choice at Qwen2.5-0.5B (student) / Qwen2.5-7B (teacher), 8 GPUs, printed
         with its terms (docs/features.md, "On-policy distillation").
"""

import argparse
import json
import os
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from memory import PROMPT, RESPONSE, measure, micro_batch, resident_mb  # noqa: E402

import config  # noqa: E402
import distill  # noqa: E402
import fsdp_train as ft  # noqa: E402
import grpo  # noqa: E402
import tiny  # noqa: E402

K = 32
SHAPE = {**tiny.QWEN25_05B, "num_hidden_layers": 2}  # 0.5B's width and vocabulary, 2 layers
ROWS = (2, 4)


def build_model(root: str) -> str:
    path = os.path.join(root, "qwen25-05b-width-2-layers")
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = tiny.build_tokenizer([r["question"] for r in tiny.make_dataset(0, 400, 10)["train"]])
        tiny.save_random_model(path, tok, **SHAPE)
    return path


def with_teacher(batch: dict, vocab: int) -> dict:
    """The batch with a teacher's top-K at every response position (ids and log-probs [rows, R, K])."""
    g = torch.Generator().manual_seed(1)
    shape = (*batch["response_mask"].shape, K)
    batch["teacher_ids"] = torch.randint(0, vocab, shape, generator=g)
    batch["teacher_logprobs"] = torch.log_softmax(torch.randn(shape, generator=g), -1)
    return batch


def update_point(model_path: str, rows: int, kind: str) -> dict:
    """One update of `kind` (plain, topk, topk-unchunked) in this process, as the loop runs it (parts.update of a
    Run with this rank's model, optimizer and schedule); the peak above the resident."""
    _, world, device = ft.init_distributed()
    model = ft.load_model(model_path, device=device, activation_checkpointing=True)
    optimizer, scheduler = ft.make_optimizer(model, lr=1e-6)
    vocab = model.config.vocab_size
    chunk = 0 if kind == "topk-unchunked" else ft.LOGPROB_CHUNK
    overrides = ["actor.entropy_coeff=0", "actor.kl_loss_coef=0.001", "data.max_response_length=512"]
    overrides += [f"actor.logprob_chunk_size={chunk}", "actor.ppo_max_token_len_per_gpu=1000000000"]
    if kind != "plain":
        overrides += [
            "distillation.enabled=true",
            "distillation.teacher_models.teacher_model.model_path=teacher",  # not loaded: the batch has its top-K
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            f"distillation.distillation_loss.topk={K}",
        ]

    def update(batch: dict) -> dict:  # one mini-batch of all the batch's rows, one micro-batch
        rows = batch["response_mask"].shape[0]
        cfg = config.load_config(None, [*overrides, f"actor.ppo_mini_batch_size={rows * world}"])
        run.cfg = cfg
        return parts.update(run, {**batch, "uid": torch.arange(rows)}, {})

    parts = grpo.choose_parts(config.load_config(None, overrides))
    record = types.SimpleNamespace(flops=ft.estimate_flops)
    run = types.SimpleNamespace(world=world, parts=parts, policy=model, optimizer=optimizer, scheduler=scheduler,
                                capture=False, model=record, peak_flops=0.0)  # fmt: skip
    update(with_teacher(micro_batch(1, vocab, 8, 8), vocab))  # warm-up: AdamW's states exist before the measurement
    batch = with_teacher(micro_batch(rows, vocab), vocab)
    return run_measured(device, lambda: update(batch), int(batch["attention_mask"].sum()))


def teacher_point(model_path: str, rows: int, kind: str) -> dict:
    """One teacher pass of `kind` (sampled, topk: FSDP2 compute_logprobs; vllm: an engine's prefill) in this
    process; the peak above what was resident before it."""
    if kind == "vllm":
        return vllm_point(model_path, rows)
    _, _, device = ft.init_distributed()
    model = ft.load_model(model_path, device=device, trainable=False)
    batch = micro_batch(rows, model.config.vocab_size)
    overrides = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=teacher",
                 f"distillation.distillation_loss.topk={K}", "actor.ppo_max_token_len_per_gpu=1000000000",
                 f"distillation.distillation_loss.loss_mode={distill.TOPK if kind == 'topk' else 'k3'}"]  # fmt: skip
    teacher = lambda path, device: model  # noqa: E731  (the model above is the teacher)
    part = distill.teacher_part(config.load_config(None, overrides), lambda run, batch: {}, lambda path: path, teacher)
    run = types.SimpleNamespace(policy=model)
    part(run, micro_batch(1, model.config.vocab_size, 8, 8))  # warm-up: the teacher "loaded", its decoder tapped
    return run_measured(device, lambda: part(run, dict(batch)), int(batch["attention_mask"].sum()))


def vllm_point(model_path: str, rows: int) -> dict:
    """veRL's teacher: the rows' tokens prefilled by a vLLM engine with prompt_logprobs=K, max_tokens 1."""
    from vllm import SamplingParams

    import rollout

    llm = rollout.make_engine(
        model_path, dtype="float32", max_model_len=PROMPT + RESPONSE + 8, gpu_memory_utilization=0.5, max_logprobs=K
    )
    batch = micro_batch(rows, tiny.QWEN25_05B["vocab_size"])
    prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(batch["input_ids"],
               batch["attention_mask"], strict=True)]  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=K, detokenize=False)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    device = torch.device("cpu")
    return run_measured(
        device, lambda: llm.generate(prompts, params, use_tqdm=False), int(batch["attention_mask"].sum())
    )


def run_measured(device, run, tokens: int) -> dict:
    resident = resident_mb("VmRSS:") if device.type == "cpu" else torch.cuda.memory_allocated() / 2**20
    start = time.perf_counter()
    peak = measure(run, device)
    return {"tokens": tokens, "peak_mb": peak, "seconds": time.perf_counter() - start, "resident_mb": resident}


def table(part: str, kinds: list[str], model: str) -> None:
    """Each kind at ROWS rows, a fresh process per point; prints the peaks and the marginal MB per token."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"{part}: peak above the resident model, rows x ({PROMPT} + {RESPONSE}) tokens, a fresh process per point")
    print(f"{'kind':<18} {'tokens':>7} {'resident MB':>12} {'peak MB':>9} {'s':>7} {'marginal MB/token':>18}")
    for kind in kinds:
        points = []
        for rows in ROWS:
            cmd = [sys.executable, __file__, "--point", part, "--kind", kind, "--rows", str(rows), "--model", model]
            out = json.loads(
                subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split("\n")[-2]
            )
            marginal = (
                (out["peak_mb"] - points[-1]["peak_mb"]) / (out["tokens"] - points[-1]["tokens"]) if points else None
            )
            points.append(out)
            print(
                f"{kind:<18} {out['tokens']:>7} {out['resident_mb']:>12.0f} {out['peak_mb']:>9.0f} "
                f"{out['seconds']:>7.1f} {'' if marginal is None else f'{marginal:.3f}':>18}",
                flush=True,
            )


GB = 1e9
TEACHER = dict(params=7.62e9, layers=28, hidden=3584, intermediate=18944, vocab=152064, embeddings=2)  # Qwen2.5-7B
GPUS, TOKENS, CHUNK, TP, SEQUENCE = 8, 16384, 512, 2, 3072  # gsm8k.yaml's GPUs, token budget, chunk, 1,024 + 2,048


def arithmetic() -> None:
    """The teacher's memory per GPU for each choice at Qwen2.5-7B (bf16), beside a Qwen2.5-0.5B student on 8 GPUs
    (the student's own: docs/memory.md, bench/fit_table.py). The terms, in GB:"""
    t = TEACHER
    root = t["embeddings"] * t["vocab"] * t["hidden"] * 2  # embed_tokens and lm_head (untied), bf16
    layer = (t["params"] - root / 2) / t["layers"] * 2  # one decoder layer's weights, bf16
    fsdp = {
        f"weights, bf16, sharded over {GPUS} GPUs (resident)": t["params"] * 2 / GPUS,
        "two decoder layers gathered (FSDP2's prefetch)": 2 * layer,
        "embed_tokens and lm_head gathered (the root, for the pass)": root,
        f"one layer's no-grad activations, {TOKENS} tokens (the MLP's 3 x [T, I])": TOKENS * 3 * t["intermediate"] * 2,
        f"the top-{K}: 3 x [{CHUNK}, V] fp32 (logits / T, log-softmax, top-k)": 3 * CHUNK * t["vocab"] * 4,
    }
    vllm = {
        f"weights, bf16, tensor parallel {TP} (resident)": t["params"] * 2 / TP,
        f"a sequence's prompt logits (bf16) and log-probs (fp32), [{SEQUENCE}, V] each": SEQUENCE * t["vocab"] * 6,
        "KV cache: gpu_memory_utilization 0.5 of an 80 GB GPU (resident)": 40 * GB,
    }
    for name, terms in (("an FSDP2 model without gradients on the trainer ranks (flatgrpo)", fsdp),
                        (f"a vLLM engine in prefill mode, TP {TP} (veRL: GPUs of its own)", vllm)):  # fmt: skip
        print(f"teacher as {name}, per GPU:")
        for term, size in terms.items():
            print(f"  {size / GB:6.2f} GB  {term}")
        resident = sum(size for term, size in terms.items() if "resident" in term)
        print(f"  {resident / GB:6.2f} GB resident, {sum(terms.values()) / GB:6.2f} GB at the teacher pass's peak")
    print(f"the batch's top-{K}: {TOKENS * K * 12 / GB:.2f} GB per {TOKENS} tokens (fp32 log-probs, int64 ids; CPU)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["update", "teacher", "arithmetic"])
    ap.add_argument("--point", choices=["update", "teacher"], help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        point = update_point if args.point == "update" else teacher_point
        print(json.dumps(point(args.model, args.rows, args.kind)))
        return
    if args.only in (None, "update"):
        table("update", ["plain", "topk", "topk-unchunked"], build_model(os.path.join(".cache", "bench")))
    if args.only in (None, "teacher"):
        table("teacher", ["sampled", "topk", "vllm"], build_model(os.path.join(".cache", "bench")))
    if args.only in (None, "arithmetic"):
        arithmetic()


if __name__ == "__main__":
    main()

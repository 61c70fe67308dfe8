"""fsdp_train's chunked log-probs and entropy at Qwen2.5's vocabulary (V = 151,936) equal the plain path:
an HF forward's full [b, R, V] logits, log-softmax at the targets, entropy (written out here), and the
gradients of a loss built from both. Tied and untied heads, chunk sizes that do and do not divide the
number of positions, padded rows and an empty response, world size 1 (in process and under torchrun)
and 2 (FSDP2: the root's embed_tokens / norm / lm_head must be unsharded for the chunked head and their
gradients reduce-scattered).

The plain path runs in float64 (the reference) and, to measure the fp32 noise, in float32 at 1 and 2
threads; the chunked path must be within fp32_noise.FACTOR x that noise (tests/helpers/fp32_noise.py). Measured
(2 x86 cores, AVX-512): noise log-probs 1.5-1.7e-6, entropy 1.4e-6, loss 0.7-1.7e-7, gradients (largest
relative, a layer-1 k_proj bias when tied) 1.1-3.2e-6; the code's error / the noise, in process at 1 and 2
threads and under torchrun at world sizes 1 and 2, any chunk size:
    log-probs 0.8-1.0   entropy 0.7-0.8   loss 0.5-1.8   gradients 0.97-1.06 (per-parameter noise: 1.3)"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import fp32_noise
import fsdp_train as ft
import losses
from conftest import run_torchrun

VOCAB = 151_936  # Qwen2.5's
SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=VOCAB,
)
TEMPERATURE, ENTROPY_COEF = 0.7, 0.003
RESPONSE_LENS = [21, 1, 0, 7, 21, 15]  # 6 rows x 21 = 126 positions; row 2 is an empty response
CHUNKS = [16, 40, 50, 1000]  # 126 = 8 x 15.75 = 4 x 31.5 = 3 x 42: none divides it; 1000: one chunk


def batch(vocab: int) -> dict:
    """6 rows: left-padded prompts of 2..8 tokens, right-padded responses (one empty), per-token weights."""
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in RESPONSE_LENS
    ]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    b = ft.make_batch(prompts, responses, pad_id=0)
    b["weights"] = torch.randn(b["response_mask"].shape, generator=g)  # [B, R], like advantages
    return b


def weighted_loss(logp, entropy, mb, counts):
    """sum(w * logp - c * entropy) over response tokens / all response tokens: a token-mean GRPO-like loss."""
    mask = mb["response_mask"]
    loss = ((logp * mb["weights"] - ENTROPY_COEF * entropy) * mask).sum() / counts["num_tokens"]
    return loss, {"loss": loss.item()}


def plain_path(model, b: dict) -> dict:
    """The definition, with nothing chunked, in the model's dtype (float64: the reference; float32: what measures
    the fp32 noise, tests/helpers/fp32_noise.py): full logits from HF's forward, log-softmax, entropy, loss, grads."""
    r = b["response_mask"].shape[1]
    dtype = next(model.parameters()).dtype
    model.zero_grad(set_to_none=True)
    pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits  # [B, P+R, V]
    logits = logits[:, -r - 1 : -1].to(dtype) / TEMPERATURE  # [B, R, V]: position t predicts token t + 1
    logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]  # [B, R]
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)  # [B, R], veRL's formula
    mask = b["response_mask"].to(dtype)
    loss = ((logp * b["weights"].to(dtype) - ENTROPY_COEF * entropy) * mask).sum() / mask.sum()
    loss.backward()
    out = {
        "logp": (logp * mask).detach(),
        "entropy": (entropy * mask).detach(),
        "loss": loss.item(),
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
    }
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def big_vocab_models(tiny_tokenizer, tmp_path_factory):
    import tiny

    root = tmp_path_factory.mktemp("big-vocab")
    return {
        name: tiny.save_random_model(
            str(root / name), tiny_tokenizer, seed=3, tie_word_embeddings=name == "tied", **SHAPE
        )
        for name in ("tied", "untied")
    }


@pytest.fixture(scope="module")
def references(big_vocab_models):
    """head -> (reference, noise): plain_path in float64 and how far fp32 lands from it at 1 and 2 threads
    (tests/helpers/fp32_noise.py), computed on first use."""
    cache = {}

    def get(head):
        if head not in cache:
            model = AutoModelForCausalLM.from_pretrained(big_vocab_models[head], dtype=torch.float32)
            b = batch(VOCAB)
            cache[head] = fp32_noise.measure(
                lambda dtype: plain_path(fp32_noise.float64_copy(model) if dtype == torch.float64 else model, b)
            )
        return cache[head]

    return get


def check_all(got: dict, reference: tuple[dict, dict], what: str):
    """Log-probs, entropy, loss and every gradient against the float64 plain path, each within FACTOR x its
    measured fp32 noise (gradients: each parameter's relative error against the largest relative noise of
    any parameter)."""
    ref, noise = reference
    for key in got:
        fp32_noise.check(got[key], ref[key], noise[key], f"{what} {key}")


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_chunked_path_equals_the_plain_path_in_process(big_vocab_models, references, head):
    model = AutoModelForCausalLM.from_pretrained(big_vocab_models[head], dtype=torch.float32)
    assert model.config.tie_word_embeddings == (head == "tied")
    b = batch(VOCAB)
    ref, noise = references(head)
    mask = b["response_mask"]
    assert ref["logp"][mask.bool()].mean() < -math.log(VOCAB) + 2  # a random model: about uniform over V
    for chunk in [0] + CHUNKS:
        model.zero_grad(set_to_none=True)
        logp, entropy = ft._forward(model, b, TEMPERATURE, losses.entropy_from_logits, chunk_size=chunk)
        loss, _ = weighted_loss(logp, entropy, b, {"num_tokens": mask.sum()})
        loss.backward()
        check_all(
            {
                "logp": logp * mask,
                "entropy": entropy * mask,
                "loss": loss.item(),
                "grads": {k: p.grad for k, p in model.named_parameters()},
            },
            (ref, noise),
            f"chunk {chunk}",
        )
        with torch.no_grad():  # the no-grad pass (old and reference log-probs): the same values
            nograd, _ = ft._forward(model, b, TEMPERATURE, chunk_size=chunk)
        fp32_noise.check(nograd * mask, ref["logp"], noise["logp"], f"chunk {chunk} no-grad logp")


def test_chunks_are_balanced_and_never_hold_the_whole_vocabulary_for_all_positions():
    seen = []

    def head(h):  # records the positions each lm_head call sees
        seen.append(h.shape[0])
        return h @ torch.ones(h.shape[1], 5)

    hidden, targets = torch.randn(1025, 3, requires_grad=True), torch.randint(0, 5, (1025,))
    logp, _ = ft.chunked_logprobs(hidden, targets, head, 1.0, chunk_size=1024)
    assert seen == [513, 512] and logp.shape == (1025,)
    seen.clear()
    logp.sum().backward()  # the backward recomputes each chunk: lm_head runs again, chunk by chunk
    assert sorted(seen) == [512, 513]


@pytest.mark.parametrize("head,world", [("tied", 1), ("tied", 2), ("untied", 2)])
def test_chunked_path_under_torchrun_equals_the_plain_path(big_vocab_models, references, tmp_path, head, world):
    """compute_logprobs and train_step under torchrun. compute_logprobs' output: exactly 0 at every position
    outside the response mask (padding), the float64 log-prob (within the fp32 noise) at every one inside."""
    path = big_vocab_models[head]
    ref, noise = references(head)
    full_mask = batch(VOCAB)["response_mask"]
    chunks = [0, 16, 40]
    reports = run_torchrun("logprob_worker.py", world, path, str(tmp_path), "--chunk-sizes", ",".join(map(str, chunks)))
    for chunk in chunks:
        logp, entropy = torch.zeros_like(ref["logp"]), torch.zeros_like(ref["entropy"])
        for rank in range(world):
            part = torch.load(tmp_path / f"logp_c{chunk}_rank{rank}.pt")
            width = part["logp"].shape[1]
            outside = full_mask[part["rows"], :width] == 0
            assert outside.any()
            assert (part["logp"][outside] == 0).all(), f"rank {rank}: a log-prob outside the response mask is not 0"
            assert (part["entropy"][outside] == 0).all(), f"rank {rank}: an entropy outside the response mask is not 0"
            logp[part["rows"], :width], entropy[part["rows"], :width] = part["logp"].double(), part["entropy"].double()
        loss = reports[0]["state"][str(chunk)]["loss"]
        grads = torch.load(tmp_path / f"grads_c{chunk}.pt")
        check_all(
            {"logp": logp, "entropy": entropy, "loss": loss, "grads": grads},
            (ref, noise),
            f"world {world} chunk {chunk}",
        )
        for r in reports:
            state = r["state"][str(chunk)]
            fp32_noise.check(state["loss"], ref["loss"], noise["loss"], f"world {world} chunk {chunk} rank loss")
            assert state["resharded_after_logprobs"]  # the no-grad pass leaves no full embed / lm_head behind
            assert state["grads_freed"]  # train_step frees the gradients right after the optimizer step
        assert all(r["all_trained"] for r in reports)  # an optimizer built after a no-grad forward trains all

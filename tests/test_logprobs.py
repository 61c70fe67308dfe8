"""fsdp_train's chunked log-probs and entropy at Qwen2.5's vocabulary (V = 151,936) equal the plain path:
an HF forward's full [b, R, V] logits, log-softmax at the targets, entropy (written out here), and the
gradients of a loss built from both. Tied and untied heads, chunk sizes that do and do not divide the
number of positions, padded rows and an empty response, world size 1 (in process and under torchrun)
and 2 (FSDP2: the root's embed_tokens / norm / lm_head must be unsharded for the chunked head and their
gradients reduce-scattered)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import fsdp_train as ft
import losses
from conftest import run_torchrun

VOCAB = 151_936  # Qwen2.5's
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=VOCAB)
TEMPERATURE, ENTROPY_COEF = 0.7, 0.003
RESPONSE_LENS = [21, 1, 0, 7, 21, 15]  # 6 rows x 21 = 126 positions; row 2 is an empty response
CHUNKS = [16, 40, 50, 1000]  # 126 = 8 x 15.75 = 4 x 31.5 = 3 x 42: none divides it; 1000: one chunk


def batch(vocab: int) -> dict:
    """6 rows: left-padded prompts of 2..8 tokens, right-padded responses (one empty), per-token weights."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in RESPONSE_LENS]
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
    """The definition, with nothing chunked: full logits from HF's forward, log-softmax, entropy, loss, grads."""
    r = b["response_mask"].shape[1]
    model.zero_grad(set_to_none=True)
    pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits  # [B, P+R, V]
    logits = logits[:, -r - 1:-1].float() / TEMPERATURE  # [B, R, V]: position t predicts token t + 1
    logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]  # [B, R]
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)  # [B, R], veRL's formula
    mask = b["response_mask"]
    loss = ((logp * b["weights"] - ENTROPY_COEF * entropy) * mask).sum() / mask.sum()
    loss.backward()
    return {"logp": (logp * mask).detach(), "entropy": (entropy * mask).detach(), "loss": loss.item(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def big_vocab_models(tiny_tokenizer, tmp_path_factory):
    import tiny
    root = tmp_path_factory.mktemp("big-vocab")
    return {name: tiny.save_random_model(str(root / name), tiny_tokenizer, seed=3, tie_word_embeddings=name == "tied",
                                         **SHAPE) for name in ("tied", "untied")}


def assert_grads_equal(grads: dict, ref: dict, rel: float = 1e-6):
    assert set(grads) == set(ref)
    for k in ref:
        assert torch.linalg.norm(grads[k] - ref[k]) <= rel * torch.linalg.norm(ref[k]), k


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_chunked_path_equals_the_plain_path_in_process(big_vocab_models, head):
    model = AutoModelForCausalLM.from_pretrained(big_vocab_models[head], dtype=torch.float32)
    assert model.config.tie_word_embeddings == (head == "tied")
    b = batch(VOCAB)
    ref = plain_path(model, b)
    mask = b["response_mask"]
    assert ref["logp"][mask.bool()].mean() < -math.log(VOCAB) + 2  # a random model: about uniform over V
    for chunk in [0] + CHUNKS:
        model.zero_grad(set_to_none=True)
        logp, entropy = ft._forward(model, b, TEMPERATURE, losses.entropy_from_logits, chunk_size=chunk)
        loss, _ = weighted_loss(logp, entropy, b, {"num_tokens": mask.sum()})
        loss.backward()
        assert ((logp - ref["logp"]) * mask).abs().max() <= 1e-6, chunk
        assert ((entropy - ref["entropy"]) * mask).abs().max() <= 1e-6, chunk
        assert loss.item() == pytest.approx(ref["loss"], rel=1e-6, abs=1e-7), chunk
        assert_grads_equal({k: p.grad for k, p in model.named_parameters()}, ref["grads"])
        with torch.no_grad():  # the no-grad pass (old and reference log-probs): the same values
            nograd, _ = ft._forward(model, b, TEMPERATURE, chunk_size=chunk)
        assert ((nograd - ref["logp"]) * mask).abs().max() <= 1e-6


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
def test_chunked_path_under_torchrun_equals_the_plain_path(big_vocab_models, tmp_path, head, world):
    path = big_vocab_models[head]
    ref = plain_path(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batch(VOCAB))
    chunks = [0, 16, 40]
    reports = run_torchrun("logprob_worker.py", world, path, str(tmp_path), "--chunk-sizes", ",".join(map(str, chunks)))
    for chunk in chunks:
        logp, entropy = torch.zeros_like(ref["logp"]), torch.zeros_like(ref["entropy"])
        for rank in range(world):
            part = torch.load(tmp_path / f"logp_c{chunk}_rank{rank}.pt")
            width = part["logp"].shape[1]
            logp[part["rows"], :width], entropy[part["rows"], :width] = part["logp"], part["entropy"]
        assert (logp - ref["logp"]).abs().max() <= 1e-6, chunk
        assert (entropy - ref["entropy"]).abs().max() <= 1e-6, chunk
        assert_grads_equal(torch.load(tmp_path / f"grads_c{chunk}.pt"), ref["grads"])
        for r in reports:
            state = r["state"][str(chunk)]
            assert state["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-7)
            assert state["resharded_after_logprobs"]  # the no-grad pass leaves no full embed / lm_head behind
            assert state["grads_freed"]  # train_step frees the gradients right after the optimizer step
        assert all(r["all_trained"] for r in reports)  # an optimizer built after a no-grad forward trains all

"""Packed micro-batches (veRL's use_remove_padding: fsdp_train.pack, varlen_attention, micro-batches of real tokens)
against an independent oracle: every sequence run ALONE through transformers' own model (no padding, no packing;
eager attention, the family's reference implementation: it honours Gemma 2's attention soft-cap, which transformers'
sdpa drops), in float64, with the fp32 noise measured here (tests/helpers/fp32_noise.py).

The trainer side is the trainer's own model (fsdp_train.load_model: its class, its attention, the family's logit
rule) through compute_logprobs with a budget of BUDGET real tokens, so the batch is cut into micro-batches of several
packed rows: a prompt of 1 token, an empty response, a response of 1 token, a row exactly at the budget, a row longer
than the budget (a micro-batch of its own). Every family of the families test (tests/test_families.py), and a
Mixture-of-Experts (Qwen3-MoE). The windows bind: Gemma 3's sliding window of 16 (its families-test config), and 16
for Gemma 2 and Mistral here, below the longest rows; Gemma 2's attention weights are scaled up so that its
soft-cap (50) changes the log-probs by far more than the noise (checked: transformers' sdpa, which drops the cap,
lands far from the oracle). A Mamba hybrid (Falcon-H1), whose layers carry state along a row, is found by
fsdp_train.packs_exactly and runs right-padded rows, against the same oracle; a padded batch through varlen_attention
is transformers' own forward bit for bit.

Isolation: changing row j's tokens leaves every other row's log-probs bit-identical. Negative controls, each seen
failing the checks here: positions numbered through the packed row instead of restarting per row (on a model whose
rotary table depends on the largest position: DYNAMIC_ROPE); one sequence over the whole packed row (rows attend to
each other). Measured (2 x86 cores, AVX-512): the trainer's error / the fp32 noise 0.70-1.21 (log-probs) and
0.77-0.97 (entropy) over the families; the negative controls 9.9e3 (positions) and 8.9e5 (one sequence) x the
noise; Falcon-H1 as right-padded rows 0.8, packed anyway 1.5e3."""

import pytest
import torch
import transformers
from test_families import FAMILIES
from test_logit_rules import FALCON_H1_SMALL
from test_moe import MOE
from trainer_models import load_as_a_run
from transformers import AutoModelForCausalLM

import fp32_noise
import fsdp_train as ft
import losses
import tiny

# RoPE is relative: shifting all of a row's positions changes its attention by rounding only, except where the rotary
# table depends on the largest position (dynamic NTK scaling, Phi-3's longrope): there positions that do not restart
# per row change the log-probs (the negative control runs on this model; every row is shorter than its 64 positions)
DYNAMIC_ROPE = dict(
    max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
)
FAMILY_MODELS = {
    **FAMILIES,
    "qwen3_moe": (transformers.Qwen3MoeConfig, MOE),
    "qwen2_dynamic_rope": (transformers.Qwen2Config, dict(FAMILIES["qwen2"][1], **DYNAMIC_ROPE)),
}
WINDOW = {"gemma2": dict(sliding_window=16), "mistral": dict(sliding_window=16)}  # Gemma 3's: FAMILIES' 16
SOFTCAP_GAIN = 50.0  # Gemma 2's q_proj and k_proj scaled by it: attention scores of tens, where a cap of 50 bites
BUDGET = 40  # real tokens per micro-batch
# (prompt, response) lengths: a 1-token prompt, an empty response, a 1-token response, one at the budget, one over it
LENGTHS = [(1, 12), (6, 0), (5, 1), (10, 30), (20, 35), (8, 17), (3, 9)]
TEMPERATURE = 0.7


def rows(vocab: int, seed: int = 0) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in LENGTHS]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in LENGTHS]
    return prompts, responses


@pytest.fixture(scope="module")
def family_model(tiny_tokenizer, tmp_path_factory):
    """family -> the path of its tiny random model, built on first use (~1 s)."""
    root, paths = tmp_path_factory.mktemp("packing-models"), {}

    def get(family):
        if family not in paths:
            config_class, keys = FAMILY_MODELS[family]
            path = str(root / family)
            tiny.save_random_family_model(path, tiny_tokenizer, config_class, seed=1, **keys, **WINDOW.get(family, {}))
            if family == "gemma2":
                sharpen_attention(path)
            paths[family] = path
        return paths[family]

    return get


def sharpen_attention(path: str) -> None:
    """Scale every q_proj and k_proj weight by SOFTCAP_GAIN (scores by its square), in place."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(SOFTCAP_GAIN)
    model.save_pretrained(path)


def oracle(path: str, attention: str = "eager"):
    """transformers' own model (its from_pretrained, not the trainer's class), experts run by the eager loop (the
    float64 copy has no grouped_mm kernel), with the family's logit rule (logit_rules: applied to its logits here)."""
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attention, experts_implementation="eager"
    ).eval()


@torch.no_grad()
def alone(model, prompts, responses, dtype) -> dict:
    """Each sequence ALONE through model.forward (its own logits, soft-caps included), in dtype (float64: a float64
    copy): {"logp", "entropy"} [B, R] at the response tokens, 0 elsewhere; entropy = logsumexp(z) - sum(p * z)."""
    m = fp32_noise.float64_copy(model) if dtype == torch.float64 else model
    width = max(map(len, responses))
    out = {
        "logp": torch.zeros(len(prompts), width, dtype=dtype),
        "entropy": torch.zeros(len(prompts), width, dtype=dtype),
    }
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not r:
            continue
        z = m(input_ids=torch.tensor([p + r]), use_cache=False).logits[0, len(p) - 1 : -1].to(dtype) / TEMPERATURE
        out["logp"][i, : len(r)] = torch.log_softmax(z, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        out["entropy"][i, : len(r)] = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    return out


def trainer_logprobs(model, prompts, responses, budget: int = BUDGET) -> dict:
    """The trainer's: compute_logprobs (packed micro-batches of `budget` real tokens) -> {"logp", "entropy"} [B, R]."""
    batch = ft.make_batch(prompts, responses, pad_id=0)
    logp, entropy = ft.compute_logprobs(
        model, batch, temperature=TEMPERATURE, max_tokens=budget, entropy_fn=losses.entropy_from_logits
    )
    return {"logp": logp, "entropy": entropy}


@pytest.fixture(scope="module")
def trainer_and_oracle(family_model):
    """family -> (the trainer's model, prompts, responses, (reference, noise)): fp32_noise.measure of `alone` on
    transformers' own model; computed on first use."""
    ft.init_distributed()
    cache = {}

    def get(family):
        if family not in cache:
            path = family_model(family)
            model = load_as_a_run(path, device=torch.device("cpu"))
            prompts, responses = rows(model.config.get_text_config().vocab_size)
            own = oracle(path)
            cache[family] = model, prompts, responses, fp32_noise.measure(lambda d: alone(own, prompts, responses, d))
        return cache[family]

    return get


def check_family(model, prompts, responses, reference, what: str, budget: int = BUDGET) -> None:
    ref, noise = reference
    got = trainer_logprobs(model, prompts, responses, budget)
    for key in ("logp", "entropy"):
        fp32_noise.check(got[key], ref[key], noise[key], f"{what} {key}")


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_packed_logprobs_and_entropy_are_each_sequence_alone(trainer_and_oracle, family):
    model, prompts, responses, reference = trainer_and_oracle(family)
    assert model.packs_sequences  # one packed row per micro-batch (packs_exactly), not the right-padded rows
    groups = ft.micro_batches(ft.make_batch(prompts, responses, pad_id=0), BUDGET)
    assert len(groups) < len(LENGTHS) and any(len(g) > 1 for g in groups)  # several rows packed together
    assert [4] in groups and [3] in groups  # over the budget (55 tokens) alone; at it (40) alone too
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if family in ("gemma2", "gemma3", "mistral"):
        assert window == 16 < max(p + r for p, r in LENGTHS)  # the window binds
    check_family(model, prompts, responses, reference, family)


def test_gemma2s_attention_softcap_bites(family_model, trainer_and_oracle):
    """A path that dropped Gemma 2's attention soft-cap would fail the oracle test: transformers' sdpa (which drops
    it) lands far from the eager oracle."""
    _, prompts, responses, (ref, noise) = trainer_and_oracle("gemma2")
    uncapped = alone(oracle(family_model("gemma2"), attention="sdpa"), prompts, responses, torch.float32)
    assert fp32_noise.error(uncapped["logp"], ref["logp"]) > 100 * fp32_noise.FACTOR * noise["logp"]


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3"])
def test_changing_one_row_leaves_every_other_row_bit_identical(trainer_and_oracle, family):
    """Full attention, soft-capped attention, sliding windows: row j's new tokens (same lengths) move no other row."""
    model, prompts, responses, _ = trainer_and_oracle(family)
    before = trainer_logprobs(model, prompts, responses)["logp"]
    vocab = model.config.get_text_config().vocab_size
    for j in (0, 3, 5):  # in the first micro-batch, alone, in a later one
        new_prompts, new_responses = rows(vocab, seed=j + 1)
        changed_p = [new_prompts[j] if i == j else p for i, p in enumerate(prompts)]
        changed_r = [new_responses[j] if i == j else r for i, r in enumerate(responses)]
        after = trainer_logprobs(model, changed_p, changed_r)["logp"]
        others = [i for i in range(len(LENGTHS)) if i != j]
        assert torch.equal(after[others], before[others]), f"row {j}'s tokens moved another row's log-probs"
        assert not torch.equal(after[j], before[j]) or not responses[j]


def broken_pack(how: str):
    """fsdp_train.pack with one deliberate bug: "positions" numbers the packed row 0..T-1 (no restart per row);
    "one sequence" makes the packed row one sequence (every row attends to the rows before it)."""
    pack = ft.pack

    def broken(mb, packs_sequences=True):
        packed = pack(mb, packs_sequences)
        tokens = packed["input_ids"].shape[1]
        if how == "positions":
            packed["position_ids"] = torch.arange(tokens)[None]
        else:
            whole = torch.tensor([0, tokens], dtype=torch.int32)
            packed["varlen"] = dict(cu_seq_lens_q=whole, cu_seq_lens_k=whole, max_length_q=tokens, max_length_k=tokens)
        return packed

    return broken


@pytest.mark.parametrize("how", ["positions", "one sequence"])
def test_negative_controls_fail_the_oracle(trainer_and_oracle, monkeypatch, how):
    model, prompts, responses, reference = trainer_and_oracle("qwen2_dynamic_rope")
    whole = sum(p + r for p, r in LENGTHS)  # one packed row of 157 tokens: past the rotary table's 64
    check_family(model, prompts, responses, reference, "whole batch in one micro-batch", budget=whole)
    monkeypatch.setattr(ft, "pack", broken_pack(how))
    with pytest.raises(AssertionError, match="x the noise"):
        check_family(model, prompts, responses, reference, f"broken: {how}", budget=whole)
    if how == "one sequence":  # rows see each other: the isolation test fails too
        with pytest.raises(AssertionError, match="moved another row"):
            test_changing_one_row_leaves_every_other_row_bit_identical(trainer_and_oracle, "qwen2_dynamic_rope")


def test_pack_layout():
    """pack's docstring example, by hand: one packed row, and the right-padded rows of a model that cannot pack."""
    mb = {
        "input_ids": torch.tensor([[0, 5, 6, 8, 0], [7, 8, 9, 10, 11]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        "response_mask": torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
    }
    packed = ft.pack(mb)
    assert packed["input_ids"].tolist() == [[5, 6, 8, 7, 8, 9, 10, 11]] and packed["attention_mask"] is None
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert packed["varlen"] == dict(
        cu_seq_lens_q=packed["varlen"]["cu_seq_lens_q"],
        cu_seq_lens_k=packed["varlen"]["cu_seq_lens_q"],
        max_length_q=5,
        max_length_k=5,
    )
    cu = packed["varlen"]["cu_seq_lens_q"]
    assert cu.tolist() == [0, 3, 8] and cu.dtype == torch.int32
    assert packed["predict"].tolist() == [1, 5, 6] and packed["targets"].tolist() == [8, 10, 11]
    assert packed["scored"].tolist() == [[True, False], [True, True]]
    rows = ft.pack(mb, packs_sequences=False)
    assert rows["input_ids"].tolist() == [[5, 6, 8, 0, 0], [7, 8, 9, 10, 11]] and rows["varlen"] == {}
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert rows["position_ids"][0, :3].tolist() == [0, 1, 2] and rows["position_ids"][1].tolist() == [0, 1, 2, 3, 4]
    assert rows["predict"].tolist() == [1, 7, 8] and rows["targets"].tolist() == [8, 10, 11]
    empty_prompt = {**mb, "attention_mask": torch.tensor([[0, 0, 0, 1, 0], [1, 1, 1, 1, 1]])}
    with pytest.raises(ValueError, match="empty prompt"):
        ft.pack(empty_prompt)


def test_a_model_that_carries_state_along_a_row_runs_right_padded_rows(tiny_tokenizer, tmp_path, monkeypatch):
    """Falcon-H1 (Mamba-2 beside attention in every layer) carries one sequence's state into the next in a packed
    row: packs_exactly says so, and its micro-batches run as right-padded rows, equal to each sequence alone. Packed
    anyway (the probe's verdict overridden), the oracle check fails."""
    path = tiny.save_random_family_model(
        str(tmp_path / "falcon_h1"), tiny_tokenizer, transformers.FalconH1Config, seed=2, **FALCON_H1_SMALL
    )
    ft.init_distributed()
    model = load_as_a_run(path, device=torch.device("cpu"))
    assert not model.packs_sequences
    prompts, responses = rows(model.config.vocab_size)
    own = oracle(path)
    reference = fp32_noise.measure(lambda d: alone(own, prompts, responses, d), threads=(1,))
    check_family(model, prompts, responses, reference, "falcon_h1 as rows")
    monkeypatch.setattr(model, "packs_sequences", True)
    with pytest.raises(AssertionError, match="x the noise"):
        check_family(model, prompts, responses, reference, "falcon_h1 packed")


@pytest.mark.parametrize(
    "family,own", [("qwen2", "sdpa"), ("gemma3", "sdpa"), ("mistral", "sdpa"), ("gemma2", "eager")]
)
def test_a_padded_batch_through_varlen_attention_is_transformers_own(family_model, family, own):
    """Outside packed rows (check_logits_fn's probe, a model switched by use_varlen_attention and then given a
    left-padded batch with its 2-D mask) varlen_attention runs transformers' own mask: the logits of transformers'
    sdpa bit for bit, windows included; Gemma 2's soft-capped attention (logit_rules.softcapped_attention, what its
    rule gives it) those of eager, the implementation that honours its soft-cap, and varlen_attention refuses it in
    one line rather than drop the cap."""
    import logit_rules

    path = family_model(family)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :7] = 0  # a left-padded row
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    ours = logit_rules.SOFTCAPPED_ATTENTION if family == "gemma2" else ft.VARLEN_ATTENTION
    with torch.no_grad():
        got, expected = (
            oracle(path, attention)(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
            for attention in (ours, own)
        )
        if family == "gemma2":
            with pytest.raises(ft.UnsupportedModel, match="attn_logit_softcapping=") as e:
                oracle(path, ft.VARLEN_ATTENTION)(input_ids=ids, attention_mask=mask, position_ids=position_ids)
            assert "\n" not in str(e.value)
    assert torch.equal(got[mask.bool()], expected[mask.bool()])


def test_a_packed_row_without_its_boundaries_is_refused(family_model):
    """Restarting positions reaching varlen_attention without cu_seq_lens would attend across the sequences."""
    model = oracle(family_model("qwen2"), ft.VARLEN_ATTENTION)
    with pytest.raises(ValueError, match="would attend across its sequences"):
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]]), use_cache=False)


# Rows of one length take varlen_attention's fast path (T = n * L: [1, H, n * L, d] unflattened to [n, H, L, d], no
# scatter): a group of responses truncated at the response budget has one length, and so do rows whose prompts and
# responses trade lengths. Each budget cuts them differently: 4 rows in one packed row, 2 and 2, each row alone (n = 1)
ONE_LENGTH = [(7, 13), (7, 13), (4, 16), (12, 8)]  # (prompt, response): every row 20 tokens
ONE_LENGTH_BUDGETS = {80: [[0, 1, 2, 3]], 40: [[0, 1], [2, 3]], 20: [[0], [1], [2], [3]]}


def one_length_batch(vocab: int) -> tuple[dict, tuple[list, list]]:
    """ONE_LENGTH's rows (rows 0 and 1 one prompt, as a group's) with per-token weights, like advantages, and the
    (prompts, responses) they hold."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in ONE_LENGTH]
    prompts[1] = prompts[0]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in ONE_LENGTH]
    batch = ft.make_batch(prompts, responses, pad_id=0)
    batch["weights"] = torch.randn(batch["response_mask"].shape, generator=g)  # [B, R]
    return batch, (prompts, responses)


def alone_with_gradients(model, batch: dict, sequences: tuple[list, list], dtype) -> dict:
    """Each sequence ALONE through transformers' own model in dtype (float64: a float64 copy), the loss of
    test_logprobs.weighted_loss summed over the sequences (token-mean over all of them) and its gradients:
    {"logp", "entropy" [B, R], "grads" {name: tensor}}."""
    from test_logprobs import ENTROPY_COEF

    m = fp32_noise.float64_copy(model) if dtype == torch.float64 else model
    m.zero_grad(set_to_none=True)
    prompts, responses = sequences
    logp, entropy = (torch.zeros(batch["response_mask"].shape, dtype=dtype) for _ in range(2))
    total = batch["response_mask"].sum()
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        z = m(input_ids=torch.tensor([p + r]), use_cache=False).logits[0, len(p) - 1 : -1].to(dtype) / TEMPERATURE
        lp = torch.log_softmax(z, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]  # [r]
        ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)  # [r]
        (((lp * batch["weights"][i, : len(r)].to(dtype)) - ENTROPY_COEF * ent).sum() / total).backward()
        logp[i, : len(r)], entropy[i, : len(r)] = lp.detach(), ent.detach()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return {"logp": logp, "entropy": entropy, "grads": grads}


@pytest.mark.parametrize("budget", list(ONE_LENGTH_BUDGETS))
def test_rows_of_one_length_are_each_sequence_alone_in_the_pass_and_the_update(family_model, budget):
    """The trainer's packed path on micro-batches whose rows all have one length (several rows, and n = 1):
    compute_logprobs' log-probs and entropy, and train_step's gradients of a token-mean loss, against each sequence
    alone through transformers' own eager model in float64, at fp32 noise. Qwen2's 4 query and 2 key-value heads:
    a fast path that reshapes [1, H, n * L, d] into [n, H, L, d] mixes heads and sequences."""
    from logprob_worker import GradRecorder
    from test_logprobs import weighted_loss

    ft.init_distributed()
    path = family_model("qwen2")
    model = load_as_a_run(path, device=torch.device("cpu"))
    assert model.packs_sequences
    batch, sequences = one_length_batch(model.config.vocab_size)
    groups = ft.micro_batches(batch, budget)
    assert groups == ONE_LENGTH_BUDGETS[budget]
    for rows in groups:  # the fast path's configuration: n rows of one length L, T = n * L
        varlen = ft.pack(ft.select(batch, rows))["varlen"]
        assert varlen["cu_seq_lens_q"].diff().tolist() == [20] * len(rows) and varlen["max_length_q"] == 20
    own = oracle(path)
    ref, noise = fp32_noise.measure(lambda d: alone_with_gradients(own, batch, sequences, d))
    logp, entropy = ft.compute_logprobs(
        model, batch, temperature=TEMPERATURE, max_tokens=budget, entropy_fn=losses.entropy_from_logits
    )
    fp32_noise.check(logp, ref["logp"], noise["logp"], f"budget {budget}: compute_logprobs logp")
    fp32_noise.check(entropy, ref["entropy"], noise["entropy"], f"budget {budget}: compute_logprobs entropy")
    recorder = GradRecorder(list(model.named_parameters()))
    ft.train_step(
        model,
        recorder,
        batch,
        weighted_loss,
        temperature=TEMPERATURE,
        max_tokens=budget,
        grad_clip=float("inf"),
        entropy_fn=losses.entropy_from_logits,
    )
    assert set(recorder.grads) == set(ref["grads"])
    fp32_noise.check(recorder.grads, ref["grads"], noise["grads"], f"budget {budget}: train_step gradients")

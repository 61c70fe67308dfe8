"""Model families whose forward does something to its logits besides the output embedding (Gemma's soft-cap,
Cohere's and Granite's scales, ...): the head the trainer's log-prob path must use to compute the model's own
log-probs; and Gemma 2's soft-capped attention scores, which no fused kernel computes. Imports torch, transformers
and fsdp_train.py, the component it extends (the plain output embedding and SDPA are its defaults, and its
start-up check, check_logits_fn, proves the head right): copy both files.

The loop enters here through the model record's load (grpo.choose_model_parts, for a config that holds a number such
a rule reads: fsdp_train.logit_rule_keys): loader.
"""

import functools
from collections.abc import Callable

import torch
from transformers import AttentionInterface, AttentionMaskInterface

import fsdp_train


def loader(load):
    """The model record's load for a family with a logit rule: load(path, ...), then its rule used (use_rule)."""

    def load_with_rule(path: str, **settings):
        model = load(path, **settings)
        use_rule(model)
        return model

    return load_with_rule


def use_rule(model) -> None:
    """The trainer's log-prob path given the family's head (logits_head, fsdp_train.use_logits_head) and, where its
    attention scores are soft-capped (Gemma 2's attn_logit_softcapping) and FlashAttention does not compute them,
    the soft-capped attention (softcapped_attention)."""
    rule, head = logits_head(model)
    if head is not None:
        fsdp_train.use_logits_head(model, rule, head)
    decoder = model.get_decoder()
    softcapped = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if softcapped and decoder.config._attn_implementation not in fsdp_train.FLASH_VARLEN:
        decoder.set_attn_implementation(SOFTCAPPED_ATTENTION)


def logits_head(model) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    """(rule, head): head(hidden [n, h]) -> logits [n, V], what the model's OWN forward computes from the
    decoder's final hidden states; rule names what it does besides the output embedding. ("none", None) for most
    families: the plain output embedding, fsdp_train's default.
    The log-prob path runs head chunk by chunk (fsdp_train.chunked_logprobs) instead of the forward's [n, V] logits,
    so whatever the family does to its logits must be here, or the trainer trains another policy than
    vLLM samples from. The output embedding is transformers' get_output_embeddings().

    What the ForCausalLM forwards of transformers 5.19 do between the decoder and the logits they return:
        final_logit_softcapping c  Gemma 2, 3, 3n, 4, VaultGemma, NanoChat           c * tanh(logits / c)
        logit_scale s              Cohere, Cohere2, Cohere2-MoE, Cohere-Compass       logits * s
        logits_scaling s           Granite, GraniteMoe (-Shared, -Hybrid), their SWA  logits / s
        logits_scaling s           HyperCLOVAX: the same key, the other way            logits * s
        lm_head_multiplier m       Falcon-H1                                          logits * m
        logits_scaling s           MiniCPM3 (s = hidden_size / dim_model_base)        head(hidden / s)
    Not reproduced here, so fsdp_train.check_logits_fn stops them at start-up: RecurrentGemma (logits_soft_cap) and
    xLSTM (output_logit_soft_cap), which vLLM does not serve; Inkling (hidden / logits_mup_width_multiplier,
    logits cut to unpadded_vocab_size); ModernBertDecoder (a dense + norm head before the output embedding).
    Mamba, Mllama, NemotronH and Blt only cast their logits to fp32, as fsdp_train.token_logprobs does.
    vLLM applies the same rules (its LogitsProcessor's scale and soft_cap), and veRL's default path reads
    model(...).logits, so they are in its log-probs too.
    Example, Gemma 2 (c = 30): a logit of 10 becomes 30 * tanh(1/3) = 9.65, one of 100 becomes 29.9.
    """
    config = model.config.get_text_config()
    head = model.get_output_embeddings()
    family = config.model_type
    if getattr(config, "final_logit_softcapping", None) is not None:  # the forward's order of operations
        cap = config.final_logit_softcapping
        return f"final_logit_softcapping: {cap} * tanh(logits / {cap})", lambda h: torch.tanh(head(h) / cap) * cap
    if family.startswith("cohere"):
        scale = config.logit_scale
        return f"logit_scale: logits * {scale}", lambda h: head(h) * scale
    if family.startswith("granite"):
        scale = config.logits_scaling
        return f"logits_scaling: logits / {scale}", lambda h: head(h) / scale
    if family == "hyperclovax":
        scale = config.logits_scaling
        return f"logits_scaling: logits * {scale}", lambda h: head(h) * scale
    if family == "falcon_h1":
        scale = config.lm_head_multiplier
        return f"lm_head_multiplier: logits * {scale}", lambda h: head(h) * scale
    if family == "minicpm3":
        scale = config.logits_scaling
        return f"logits_scaling: head(hidden / {scale})", lambda h: head(h / scale)
    return "none", None  # the plain output embedding: fsdp_train's own head


SOFTCAPPED_ATTENTION = fsdp_train.VARLEN_ATTENTION + "_softcapped"  # transformers' AttentionInterface name


def softcapped_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """fsdp_train.varlen_attention for a model whose attention scores are soft-capped (Gemma 2: softcap * tanh(s /
    softcap) before the softmax), which no fused kernel computes: the rows of a packed row (fsdp_train.rows_attention)
    through eager_softcapped. FlashAttention 2 soft-caps itself (a GPU with flash-attn, 16-bit compute)."""
    attend = functools.partial(
        eager_softcapped, module, dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap
    )
    position_ids = kwargs.get("position_ids")
    return fsdp_train.rows_attention(
        attend, query, key, value, attention_mask, cu_seq_lens_q, max_length_q, position_ids
    ), None


def eager_softcapped(module, q, k, v, mask, *, dropout: float, scaling, sliding_window, softcap) -> torch.Tensor:
    """transformers' eager attention with soft-capped scores, on rows [n, H, L, d] (keys and values [n, K, L, d]) ->
    [n, H, L, d]: scores softcap * tanh(q k^T * scaling / softcap), masked (causal and within the sliding window:
    fsdp_train.causal_mask; or as the 4-D mask says, True: attend), softmax in fp32 (or wider), dropout, times v."""
    groups = q.shape[1] // k.shape[1]
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    if softcap is None:  # a layer without a cap in such a model: plain attention
        return fsdp_train.causal_attention(module, q, k, v, mask, dropout, scaling, sliding_window)
    mask = fsdp_train.causal_mask(q.shape[2], sliding_window, q.device) if mask is None else mask  # [L, L]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # [n, H, L, d]
    scores = torch.tanh(q @ k.transpose(-1, -2) * scaling / softcap) * softcap  # [n, H, L, L]
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    return torch.nn.functional.dropout(probs, p=dropout, training=module.training) @ v


AttentionInterface.register(SOFTCAPPED_ATTENTION, softcapped_attention)
AttentionMaskInterface.register(SOFTCAPPED_ATTENTION, fsdp_train.varlen_mask)

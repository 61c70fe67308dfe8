"""Model families whose forward does something to its logits besides the output embedding (Gemma's soft-cap,
Cohere's and Granite's scales, ...): the head the trainer's log-prob path must use to compute the model's own
log-probs. Imports torch only: copy it with fsdp_train.py, which it plugs into (load_model's `head`; the plain
output embedding is fsdp_train's default, and its start-up check, check_logits_fn, proves the head right).
"""

from collections.abc import Callable

import torch


def logits_head(model) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    """(rule, head): head(hidden [n, h]) -> logits [n, V], what the model's OWN forward computes from the
    decoder's final hidden states; rule names what it does besides the output embedding. ("none", None) for most
    families: the plain output embedding, fsdp_train's default. fsdp_train.load_model's `head`.
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

"""The trainer's model as a run of its family loads it, for the tests and workers that build one by hand."""

import fsdp_train
import logit_rules


def load_as_a_run(path: str, **settings):
    """fsdp_train.load_model with the family's logit rule where its config holds one (logit_rules.loader, as
    grpo.choose_model_parts chooses it), then proven to compute the model's own logits (fsdp_train.check_logits_fn,
    as grpo.load_models does)."""
    load = fsdp_train.load_model
    if fsdp_train.logit_rule_keys(fsdp_train.AutoConfig.from_pretrained(path)):
        load = logit_rules.loader(load)
    model = load(path, **settings)
    fsdp_train.check_logits_fn(model)
    return model

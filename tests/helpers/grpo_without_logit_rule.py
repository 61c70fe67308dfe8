"""grpo.py with the trainer's log-prob path stripped of the model family's logit rule (logit_rules.logits_head
hands over no rule: the bare output embedding) and load_model's start-up check of it switched off: the trainer then
computes another policy than vLLM samples from (the bug of issue 29). Used by tests/test_logit_rules.py: the
start-up sync check must stop the run anyway.

    python tests/helpers/grpo_without_logit_rule.py --config tiny.yaml [key=value ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cluster  # noqa: E402
import fsdp_train  # noqa: E402
import grpo  # noqa: E402
import logit_rules  # noqa: E402

logit_rules.logits_head = lambda model: ("none", None)  # the injected fault
fsdp_train.check_logits_fn = lambda model: None  # ... which the load-time check would have caught
cluster.end_process(grpo.main(sys.argv[1:]))  # as grpo.py ends

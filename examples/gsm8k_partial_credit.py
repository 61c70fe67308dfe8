"""A reward file in veRL's format: GSM8K with partial credit for the right format.
python grpo.py --config tiny.yaml custom_reward_function.path=examples/gsm8k_partial_credit.py"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right number after "#### ", 0.1 for another number there, 0 without one; "acc" and "pred"
    are logged too (veRL: acc becomes the val-core metric, pred is voted on for maj@k)."""
    found = re.findall(r"#### (-?[0-9.,]+)", solution_str[-300:])
    pred = found[-1].replace(",", "") if found else "[no answer]"
    return {
        "score": 1.0 if pred == ground_truth else 0.1 if found else 0.0,
        "acc": float(pred == ground_truth),
        "pred": pred,
    }

"""A reward file (custom_reward_function.path) for the dynamic-sampling tests in tests/test_cluster.py: which groups
have a reward signal is set by the prompt, so the groups a run keeps can be worked out apart from the run.

The prompt's index (extra_info["index"], the row of a GSM8K-layout file) decides: a prompt with index % 3 == 0 or
index % 7 == 2 scores 1.0 (no signal: dynamic sampling must drop its group; the irregular pattern makes the steps
take 2 or 3 generation batches of 3 prompts, some with a surplus); the others score the parity of the call's number in
this process, 0.0, 1.0, 0.0, 1.0 for the n samples of a group (grpo.sample_and_score scores a group's samples one after
the other; with an even n every group starts at an even number). The tiny model often samples n identical
responses, so a reward read from the text alone would leave most groups without a signal. With REWARD_LOG set to a
directory, every call appends {"index", "score"} to <REWARD_LOG>/<pid>.jsonl (one file per process).
"""

import itertools
import json
import os

CALLS = itertools.count()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    index = extra_info["index"]
    parity = float(next(CALLS) % 2)
    score = 1.0 if index % 3 == 0 or index % 7 == 2 else parity
    if os.environ.get("REWARD_LOG"):
        with open(os.path.join(os.environ["REWARD_LOG"], f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"index": index, "score": score}) + "\n")
    return score

"""A reward file (custom_reward_function.path) for the dynamic-sampling tests in tests/test_cluster.py: which groups
have a reward signal is known from the rewards it hands out, so the groups a run keeps can be worked out apart from
the run.

The prompt's index (extra_info["index"], the row of a GSM8K-layout file) decides: every third prompt (index % 3 == 0)
scores 1.0 whatever the response (no signal: dynamic sampling must drop its group); the others score the parity of
the response's length, 0.0 or 1.0 (most groups of 4 then differ). With REWARD_LOG set to a directory, every call
appends {"index", "score"} to <REWARD_LOG>/<pid>.jsonl (one file per process: ranks do not share one).
"""

import json
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    index = extra_info["index"]
    score = 1.0 if index % 3 == 0 else float(len(solution_str) % 2)
    if os.environ.get("REWARD_LOG"):
        with open(os.path.join(os.environ["REWARD_LOG"], f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"index": index, "score": score}) + "\n")
    return score

"""How torchrun test workers hand their results back: one JSON file per rank (stdout lines of two
ranks can interleave)."""

import json
import os


def report(rank: int, result: dict) -> None:
    path = os.path.join(os.environ["TEST_RESULTS"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, **result}, f)
    os.replace(path + ".tmp", path)

"""grpo.setup() on a resumed run, then: do Python's, NumPy's and torch's RNG states equal those saved in
the checkpoint? (vLLM re-seeds them when its engine starts, so they must be restored after it.)

    python tests/helpers/setup_worker.py CHECKPOINT_DIR --config tiny.yaml key=value ...   # prints one JSON line
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import config  # noqa: E402
import grpo  # noqa: E402

checkpoint, config_file, overrides = sys.argv[1], sys.argv[3], sys.argv[4:]
cfg = config.load_config(config_file, overrides)
run = grpo.setup(cfg, grpo.choose_parts(cfg))
saved = torch.load(os.path.join(checkpoint, "state_rank0.pt"), weights_only=False)["extra"]["rng"]
print(
    json.dumps(
        {
            "start": run.start,
            "engine": run.llm is not None,
            "torch": torch.equal(torch.get_rng_state(), saved["torch"]),
            "python": random.getstate() == saved["python"],
            "numpy": all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), saved["numpy"], strict=True)),
        }
    )
)

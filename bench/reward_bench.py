"""Scoring cost of 1 MB responses (the reward must stay linear-time: no regex backtracking).

    .venv/bin/python bench/reward_bench.py

Prints milliseconds per compute_score call on adversarial 1 MB strings, with veRL's 300-character
window (the default) and with the window lifted (clip_chars=None, the whole string scanned).
Target: < 10 ms per 1 MB string.
"""

import os
import random
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reward import compute_score  # noqa: E402

MB = 1 << 20
rng = random.Random(0)
cases = {
    "random printable": "".join(rng.choice(string.printable) for _ in range(MB)),
    "digits and commas": "1," * (MB // 2),
    "many '#### '": "#### " * (MB // 5),
    "hashes, no space": "#" * MB,
    "unicode": "数字٣🙂" * (MB // 4),
}
columns = [(m, c) for m in ("strict", "flexible") for c in (300, None)]
print(f"{'input (1 MiB), ms/call':<24}" + "".join(f"{m + (' w300' if c else ' whole'):>16}" for m, c in columns))
for name, text in cases.items():
    row = []
    for method, clip in columns:
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            compute_score(text, "1", method=method, clip_chars=clip)
        row.append((time.perf_counter() - t0) / reps * 1000)
    print(f"{name:<24}" + "".join(f"{ms:>16.3f}" for ms in row))

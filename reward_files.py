"""A user's reward function from a Python file (veRL's custom_reward_function.path / .name): the task's score
in place of the GSM8K rule. Standard library only: copy it anywhere.

    score = load_scorer("my_reward.py", "compute_score")
    score(row, "the response text", cfg["reward"])   # -> (reward, extras); the reward.* keys unused

The file's function has veRL's signature, compute_score(data_source, solution_str, ground_truth, extra_info),
and returns a number, or a dict with a numeric "score" whose other keys are extra outputs (logged as
reward_extra_info/<key>/mean when numeric, and written with validation generations).
"""

import importlib.util
import math
import numbers
import os


class RewardFileError(ValueError):
    """A reward file that cannot be used, or a return value that is not a finite number: one line."""


def scorer(settings: dict):
    """The loop's scorer part (grpo.choose_parts) from custom_reward_function's keys: load_scorer(path, name)."""
    return load_scorer(settings["path"], settings["name"])


def load_scorer(path: str, name: str):
    """score(row, text, settings) -> (reward: float, extras: dict) with the function `name` of the file `path`
    (settings, the reward.* keys of the built-in scorer, unused: the file's function has its own), loaded
    once per process; row: a data row ({"data_source", "ground_truth", "extra_info", "where"}). A return that is
    not a finite number (or a dict with one as "score") raises RewardFileError naming the file and the row."""
    fn = load_reward_function(path, name)

    def custom(row, text, settings=None):
        out = fn(
            data_source=row["data_source"],
            solution_str=text,
            ground_truth=row["ground_truth"],
            extra_info=row["extra_info"],
        )
        value, extras = out, {}
        if isinstance(out, dict):  # {"score": ..., other keys: extras}
            extras = dict(out)
            value = extras.pop("score", None)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardFileError(
                f"custom_reward_function: {path}:{name} returned {out!r} for {row['where']}; accepted: "
                "a finite number, or a dict with a numeric 'score'"
            )
        return float(value), extras

    return custom


def load_reward_function(path: str, name: str):
    """The function `name` of the Python file `path` (custom_reward_function.path / .name)."""
    if not os.path.isfile(path):
        raise RewardFileError(f"config: custom_reward_function.path = {path!r}: no such file")
    spec = importlib.util.spec_from_file_location("custom_reward", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise RewardFileError(
            f"config: custom_reward_function.path = {path!r}: importing it failed ({type(e).__name__}: {e})"
        ) from None
    if not callable(getattr(module, name, None)):
        raise RewardFileError(f"config: custom_reward_function.name = {name!r}: {path} defines no function {name}")
    return getattr(module, name)

"""reward.py against hand-worked GSM8K cases (veRL's scorer, quirks included)."""

import random
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo import overlong_penalty
from reward import (
    CLIP_CHARS,
    INSTRUCTION,
    compute_score,
    extract_ground_truth,
    extract_solution,
    make_prompt,
)


def test_make_prompt_is_verl_single_user_message():
    msgs = make_prompt("Tom has 3 apples. How many?")
    assert msgs == [
        {
            "role": "user",
            "content": "Tom has 3 apples. How many? "
            'Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert INSTRUCTION.startswith("Let's think")


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("big\n#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("#### 2.5", "2.5"),
        ("first #### 7 then #### 8", "7"),  # the FIRST match (preprocessing), unlike the scorer
    ],
)
def test_extract_ground_truth(answer, truth):
    assert extract_ground_truth(answer) == truth


@pytest.mark.parametrize("bad", ["no answer here", "####5", "", None])
def test_extract_ground_truth_without_answer_raises(bad):
    with pytest.raises(ValueError, match="####"):
        extract_ground_truth(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is\n#### 18", "18"),
        ("####18", None),  # no space: no answer
        ("####  18", None),  # two spaces: no answer
        ("#### 18.", "18."),  # the trailing dot is captured
        ("#### 1,234", "1234"),  # commas removed
        ("#### -3", "-3"),
        ("#### 0.5", "0.5"),
        ("#### 1 and later #### 2", "2"),  # the LAST match
        ("##### 4", "4"),  # five hashes contain "#### 4"
        ("#### $5", None),  # "$" cannot be captured
        ("", None),
    ],
)
def test_extract_solution_strict(text, expected):
    assert extract_solution(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", "42."),  # nothing stripped
        ("1, 2, 3", "3"),
        ("x = -7 units", "-7"),
        ("no digits at all", None),
        ("a . b", "."),  # veRL's loop falls through to the only match
        ("12 then .", "12"),  # "." is skipped
        ("#### 1,000", "1,000"),  # commas kept in flexible mode
    ],
)
def test_extract_solution_flexible(text, expected):
    assert extract_solution(text, method="flexible") == expected


def test_only_the_last_300_characters_are_scored():
    assert CLIP_CHARS == 300
    inside = "#### 42" + "x" * (300 - 7)  # exactly 300 chars: kept whole
    outside = "#### 42" + "x" * (301 - 7)  # 301 chars: the first "#" falls off
    assert extract_solution(inside) == "42"
    assert extract_solution(outside) is None
    assert compute_score("#### 42" + " filler" * 50, "42") == 0.0  # veRL's quirk
    assert compute_score("#### 42" + " filler" * 50, "42", clip_chars=None) == 1.0  # lifted
    assert extract_solution("#### 123" + "x" * 297) is None  # window cuts into "####"


def test_compute_score_string_equality_and_scores():
    assert compute_score("#### 72", "72") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 72.0", "72") == 0.0  # no numeric normalisation
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1  # answer present but wrong
    assert compute_score("no answer", "72", format_score=0.1) == 0.0  # no answer: 0, not format_score
    assert compute_score("#### 72", "72", score=2.0) == 2.0
    assert compute_score("#### 1,234", "1234") == 1.0
    assert compute_score("The answer: 72", "72", method="flexible") == 1.0


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="strict, flexible"):
        extract_solution("#### 1", method="lenient")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\x00\x01\xff" * 1000,
        "".join(map(chr, range(0, 0x3000, 7))),
        "数字 #### ٣ 🙂 #### 5",
        "#" * 100_000,
        "-" * 100_000 + "#### -",
    ],
)
def test_never_raises_on_odd_strings(text):
    for method in ("strict", "flexible"):
        for clip in (CLIP_CHARS, None):
            assert compute_score(text, "5", method=method, clip_chars=clip) in (0.0, 1.0)


def test_one_megabyte_strings_score_correctly():
    # Linear-time patterns: these finish instantly (timings: bench/reward_bench.py).
    rng = random.Random(0)
    noise = "".join(rng.choice(string.printable) for _ in range(1 << 20))
    assert compute_score(noise + "\n#### 17", "17") == 1.0
    assert compute_score("#### 17" + noise, "17", clip_chars=None) in (0.0, 1.0)
    near_miss = "#### " + "1," * (1 << 19)  # one huge capture group
    assert extract_solution(near_miss, clip_chars=None) == "1" * (1 << 19)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000), st.sampled_from(["strict", "flexible"]))
def test_property_total_and_consistent(text, method):
    answer = extract_solution(text, method=method)
    score = compute_score(text, "7", method=method)
    assert score == (1.0 if answer == "7" else 0.0)
    if answer is not None and method == "strict":
        assert "," not in answer and set(answer) <= set("-0123456789.")


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**9), 10**9), st.text(alphabet=string.ascii_letters + " \n", max_size=200))
def test_property_appended_answer_always_found(n, prefix):
    assert compute_score(prefix + f"\n#### {n}", str(n)) == 1.0
    assert compute_score(prefix + f"\n#### {n:,}", str(n)) == 1.0  # thousands separators


# ---------------------------------------------------------------- DAPO overlong penalty
def _verl_overlong(length, max_len, buffer_len, factor):
    """veRL's expression (experimental/reward_loop/reward_manager/dapo.py) on a 0-d int64 tensor, as veRL runs it."""
    valid_response_length = torch.ones(length, dtype=torch.int64).sum()  # an attention-mask sum: 0-d int64
    exceed_len = valid_response_length - (max_len - buffer_len)
    return min(-exceed_len / buffer_len * factor, 0)


def test_overlong_penalty_bit_equal_to_verl_torch():
    rng = random.Random(0)
    factors = [0.1, 1.0, 0.7, 0.3, 1 / 3, 0.5, 2.0, 0.05, 0.9, 1.5]
    checked = 0
    for _ in range(3000):
        buffer_len = rng.choice([1, 3, 7, 10, 64, 100, 333, 1000, 1024, 4096, rng.randint(1, 8000)])
        max_len = buffer_len + rng.randint(0, 8000)
        near_end = rng.random() < 0.8
        length = rng.randint(max(0, max_len - buffer_len - 3) if near_end else 0, max_len)
        factor = rng.choice(factors + [rng.uniform(0, 3)])
        want = _verl_overlong(length, max_len, buffer_len, factor)
        got = overlong_penalty(length, max_len, buffer_len, factor)
        in_buffer = torch.is_tensor(want)  # else veRL's min() returned the int 0
        assert type(got) is float and got == (want.item() if in_buffer else want), (length, max_len, buffer_len, factor)
        checked += in_buffer
    assert checked > 1500  # most cases inside the buffer (a float32 tensor in veRL), the rest the int 0 branch


def test_overlong_penalty_hand_values():
    assert overlong_penalty(10, 20, 10, 1.0) == 0.0  # at the buffer start
    assert overlong_penalty(3, 20, 10, 1.0) == 0.0  # before it: Python's min(x, 0) gives 0
    assert overlong_penalty(15, 20, 10, 1.0) == -0.5
    assert overlong_penalty(20, 20, 10, 1.0) == -1.0
    assert overlong_penalty(13, 20, 10, 0.1) == -0.030000001192092896  # float32: f32(f32(-0.3) * f32(0.1))
    assert overlong_penalty(13, 20, 10, 0.1) != -3 / 10 * 0.1


@pytest.mark.parametrize("args", [(5, 20, 0, 1.0), (5, 20, -1, 1.0), (5, 8, 10, 1.0)])
def test_overlong_penalty_bad_config(args):
    with pytest.raises(ValueError, match="buffer_length=.*max_response_length="):
        overlong_penalty(*args)

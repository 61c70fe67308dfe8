"""GSM8K prompt and answer scoring, identical to veRL's. Standard library only.

Copy this file anywhere; it imports nothing but `re`.

veRL sources reproduced here, quirks included:
  examples/data_preprocess/gsm8k.py   -> make_prompt, extract_ground_truth
  verl/utils/reward_score/gsm8k.py    -> extract_solution, compute_score

Worked example:
    >>> make_prompt("What is 2+3?")[0]["content"]
    'What is 2+3? Let\\'s think step by step and output the final answer after "####".'
    >>> extract_ground_truth("2+3=5\\n#### 5")
    '5'
    >>> compute_score("2+3=5 so #### 5", "5"), compute_score("####5", "5")
    (1.0, 0.0)
"""

import re

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
CLIP_CHARS = 300  # veRL's _SOLUTION_CLIP_CHARS: only the tail of a response is scored
METHODS = ("strict", "flexible")

# "####", ONE space, then an optionally negative run of digits, dots and commas.
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def make_prompt(question: str) -> list[dict]:
    """veRL's GSM8K prompt: one user message, no system message.

    content = question + " " + INSTRUCTION; the chat template is applied later
    (add_generation_prompt=True) by whoever renders it.
    """
    return [{"role": "user", "content": question + " " + INSTRUCTION}]


def extract_ground_truth(answer: str) -> str:
    """The ground truth of a GSM8K `answer` field: the FIRST `#### N` match, commas removed.

    "Natalia sold 48/2 = 24 clips...\\n#### 72" -> "72";  "#### 1,234" -> "1234".
    Raises ValueError when the field has no `#### N` (veRL asserts): a dataset row
    without an answer must stop the run, not train on garbage.
    """
    match = _STRICT.search(answer) if isinstance(answer, str) else None
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {str(answer)[-80:]!r}")
    return match.group(1).replace(",", "")


def extract_solution(solution_str: str, method: str = "strict", clip_chars: int | None = CLIP_CHARS) -> str | None:
    """The model's final answer, or None (veRL `gsm8k.extract_solution`).

    Only the last `clip_chars` characters are searched (veRL: 300; `clip_chars=None` lifts it).
    strict:   LAST match of `#### (-?[0-9.,]+)`, with "," and "$" removed.
              "#### 18" -> "18";  "####18" -> None;  "#### 18." -> "18.";  "#### 1,234" -> "1234".
    flexible: LAST match of `(-?[0-9.,]+)` that is not "" or "." (if every match is ".",
              veRL's loop leaves "." ), nothing stripped.
    Never raises on a string; linear time (the patterns cannot backtrack catastrophically).
    """
    if method not in METHODS:
        raise ValueError(f"extract_solution: method={method!r}; accepted: {', '.join(METHODS)}")
    if clip_chars is not None and len(solution_str) > clip_chars:
        solution_str = solution_str[-clip_chars:]
    if method == "strict":
        solutions = _STRICT.findall(solution_str)
        if not solutions:
            return None
        return solutions[-1].replace(",", "").replace("$", "")
    return _flexible_answer(solution_str)


def _flexible_answer(solution_str: str) -> str | None:
    """extract_solution's flexible method: the LAST number-like run that is not "" or "." (veRL's loop)."""
    answers = _FLEXIBLE.findall(solution_str)
    final_answer = None
    for final_answer in reversed(answers):  # veRL's loop: falls through to answers[0]
        if final_answer not in ("", "."):
            break
    return final_answer


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    clip_chars: int | None = CLIP_CHARS,
) -> float:
    """veRL `gsm8k.compute_score`: no answer -> 0; answer == ground_truth (STRING equality) -> score;
    any other answer -> format_score. No numeric normalisation: "18.0" != "18".

    solution_str is the response only, decoded with skip_special_tokens=True.
    """
    answer = extract_solution(solution_str, method=method, clip_chars=clip_chars)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)

"""GSM8K rule-based reward, bit-for-bit the semantics of verl's scorer.

Reference: volcengine/verl, `verl/utils/reward_score/gsm8k.py` (`extract_solution`,
`compute_score`), itself following ReFT (Trung et al., ACL 2024). The RL runs here are compared
against verl runs, so the reward must be the same function of the decoded text, quirks included;
anything "cleaner" would change the learning signal and break the comparison.

Semantics:

* Window: only the last 300 characters of the response are examined (verl clips
  `solution_str[-300:]` so the regex is cheap on long rollouts). A `####` answer that starts
  before that window is invisible, and so is a `#### ` marker cut by the window's left edge.
* strict: `re.findall(r"#### (\\-?[0-9\\.\\,]+)", s)`; no match -> None; otherwise the LAST
  match with "," and "$" removed. The regex needs exactly one space after `####` and then an
  optional "-" followed by at least one of `[0-9.,]`, so "#### $5", "####5", "####  5" and
  "#### -" do not match. The "$" replace is dead code in strict mode (the capture group
  cannot contain "$"); it is kept because verl has it.
* flexible: `re.findall(r"(\\-?[0-9\\.\\,]+)", s)`; no match -> None; otherwise the last match
  that is not "" or "."; no "," or "$" stripping at all (verl's flexible branch has no replace).
  If every match is "." the result is "." (see `_extract_flexible`).
* Score: `None -> 0`; plain string equality with the ground truth -> `score`; otherwise
  `format_score`. Nothing is parsed as a number.

Pitfalls (all inherited from verl, on purpose):

* `[0-9]` is ASCII only: Arabic-Indic ("٣") or full-width ("４２") digits are never matched.
* Numbers compare as strings: "#### 3.50" against "3.5", "#### 42.0" against "42" and
  "#### 42." against "42" all score `format_score`, not `score`.
* Flexible mode keeps commas and trailing dots: "1,234" != "1234" and "is 42." gives "42.".
* Strict mode strips every comma anywhere in the match: "#### -,5" gives "-5", "#### ,,," gives ""
  (which equals an empty ground truth).

boxed (not verl's GSM8K scorer; for instruct models that answer in LaTeX, as Qwen2.5 does:
`\\boxed{…}` in 24 of 32 GSM8K answers, `####` in none):

* Reading: the content of the last `\\boxed{…}` whose braces balance (nested braces kept; a box
  left open by the token limit is skipped for an earlier closed one); with none, the strict
  `#### N` reading above (in its 300-character window). The box is searched in the whole text.
* Normalisation, of both the answer and the ground truth, repeated to a fixed point: strip
  whitespace; drop a `\\text{…}`, `\\mbox{…}` or `\\mathrm{…}` unit after a number
  ("18 \\text{ dollars}" -> "18"); drop `\\$`, `$`, `\\%`, `%`; `{,}` (LaTeX's thousands comma)
  -> `,`; a trailing `.`; thousands commas ("1,234" -> "1234", but "1,23" is kept).
* Comparison: numerically when both sides are plain decimals (`-?digits[.digits]`: "3.50" ==
  "3.5", "42.0" == "42"), else as the normalised strings.

Where it departs from verl's `math` reward (`verl/utils/reward_score/math.py`, Hendrycks'
MATH `is_equiv`): verl reads only `\\boxed`/`\\fbox` and has no `####` fallback; it compares
strings after its own `strip_string` (no numeric comparison, so "42.0" != "42"; thousands commas
kept; `\\text{ …}` units removed only with a space after the brace; `\\frac`/`\\dfrac`, `a/b` and
leading-zero rewriting that GSM8K's integer answers never need); it takes the LAST `\\boxed`
even when its braces do not close (then no answer). Scores are `score` / `format_score` / 0 as
in the GSM8K scorer above, not verl math's 1.0 / 0.0.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from aqn_jax.registry import Registry

# verl's _SOLUTION_CLIP_CHARS.
SOLUTION_CLIP_CHARS = 300


def _hash_answer(ground_truth: str) -> str:
    return f"#### {ground_truth}"


@dataclasses.dataclass(frozen=True)
class Method:
    """A reading of a response (config.data.reward_method): the answer it extracts (None: no
    answer), when that answer equals the ground truth, how reports name the reading (`title`)
    and the answer line a few-shot example shows for a ground truth (`shot`: the form the
    reading reads)."""

    extract: Callable[[str], str | None]
    equal: Callable[[str, str], bool]
    title: str
    shot: Callable[[str], str] = _hash_answer


METHODS: Registry[Method] = Registry("config.data.reward_method")


def register_method(
    name: str,
    equal: Callable[[str, str], bool],
    title: str,
    shot: Callable[[str], str] = _hash_answer,
):
    """`@register_method(name, equal, title, shot)` on the method's `extract`: a new reading is
    this one decorator (the data checks, few-shot prompts and the evaluate report read it)."""

    def wrap(fn):
        METHODS.register(name, Method(fn, equal, title, shot))
        return fn

    return wrap


def _same_string(answer: str, ground_truth: str) -> bool:
    return answer == ground_truth


# verl's patterns verbatim (the escapes inside the character class are redundant but harmless).
_STRICT_RE = re.compile("#### (\\-?[0-9\\.\\,]+)")
_FLEXIBLE_RE = re.compile("(\\-?[0-9\\.\\,]+)")
# verl's invalid_str. "" can never occur (the group needs one character); only "." matters.
_INVALID = ("", ".")
_BOX = "\\boxed{"
_UNIT_RE = re.compile(r"^(.*\d)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL_RE = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")


def _last_boxed(solution_str: str) -> str | None:
    """The content of the last `\\boxed{…}` whose braces balance, or None."""
    start = solution_str.rfind(_BOX)
    while start >= 0:
        depth, i = 1, start + len(_BOX)
        while i < len(solution_str) and depth:
            depth += {"{": 1, "}": -1}.get(solution_str[i], 0)
            i += 1
        if depth == 0:
            return solution_str[start + len(_BOX) : i - 1]
        start = solution_str.rfind(_BOX, 0, start)
    return None


def normalize_answer(answer: str) -> str:
    """The boxed reading's normalisation (module docstring), applied to both sides, repeated
    until nothing changes (so "5 \\text{ cm}$." and its normalised form normalise alike)."""
    s, prev = answer, None
    while s != prev:
        prev, s = s, s.strip()
        unit = _UNIT_RE.match(s)
        if unit:
            s = unit.group(1)
        for token in ("\\$", "$", "\\%", "%"):
            s = s.replace(token, "")
        s = s.replace("{,}", ",").strip()
        if s.endswith("."):
            s = s[:-1].rstrip()
        if _THOUSANDS_RE.match(s):
            s = s.replace(",", "")
    return s


def answers_equal(a: str, b: str) -> bool:
    """Normalised `a` and `b` are the same number (both plain decimals) or the same string."""
    a, b = normalize_answer(a), normalize_answer(b)
    if _DECIMAL_RE.match(a) and _DECIMAL_RE.match(b):
        return float(a) == float(b)
    return a == b


@register_method("strict", _same_string, "strict `####`")
def _extract_strict(solution_str: str) -> str | None:
    """verl's strict branch: the last `#### N` match in the window, "," and "$" removed."""
    # verl: `if len(s) > 300: s = s[-300:]`, which is the same as an unconditional s[-300:].
    solutions = _STRICT_RE.findall(solution_str[-SOLUTION_CLIP_CHARS:])
    if not solutions:
        return None
    # Last match wins; the "$" replace cannot fire (see the module docstring) but is verl's.
    return solutions[-1].replace(",", "").replace("$", "")


@register_method("flexible", _same_string, "flexible: the last number")
def _extract_flexible(solution_str: str) -> str | None:
    """verl's flexible branch: the last number-like match in the window that is not "" or ".".

    verl writes `for final_answer in reversed(answer): if final_answer not in invalid_str: break`.
    When every match is invalid the loop never breaks, and the loop variable keeps the last value
    it was bound to, i.e. `answer[0]` (the FIRST match in the text), which is always "." here.
    So "a . b ." returns "." rather than None, and scores `score` against a ground truth of ".".
    Reproduced deliberately. No "," / "$" stripping: verl's flexible branch has none.
    """
    answer = _FLEXIBLE_RE.findall(solution_str[-SOLUTION_CLIP_CHARS:])
    if not answer:
        return None
    for candidate in reversed(answer):
        if candidate not in _INVALID:
            return candidate
    return answer[0]  # the all-invalid quirk described above


@register_method(
    "boxed",
    answers_equal,
    "boxed: the last `\\boxed{}`, else `####`",
    shot=lambda ground_truth: f"\\boxed{{{ground_truth}}}",
)
def _extract_boxed(solution_str: str) -> str | None:
    """The normalised content of the last closed `\\boxed{…}` in the whole text, else the
    normalised strict answer (module docstring)."""
    boxed = _last_boxed(solution_str)
    answer = boxed if boxed is not None else _extract_strict(solution_str)
    return None if answer is None else normalize_answer(answer)


GSM8K_METHODS = ("strict", "flexible")  # verl's GSM8K scorer, bit for bit


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string verl's GSM8K scorer would extract, or None (for "boxed": the normalised
    boxed or strict answer, module docstring).

    Same code path as verl's `extract_solution` (see the module docstring). The only deviation
    is that an unknown `method` raises ValueError instead of verl's `assert`, so the check
    survives `python -O`. Never raises for any str input.
    """
    return METHODS.get(method).extract(solution_str)


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K `compute_score`: 0 without an answer, `score` if equal, else `format_score`.

    Equality is on strings, as in verl ("42.0" != "42"). Returned as float (verl returns the int 0
    for a missing answer; the value is the same).
    """
    entry = METHODS.get(method)
    answer = entry.extract(solution_str)
    if answer is None:
        return 0.0
    return float(score) if entry.equal(answer, ground_truth) else float(format_score)


def score_batch(
    solutions: Sequence[str],
    ground_truths: Sequence[str],
    **kw,
) -> np.ndarray:
    """`compute_score` over a batch of decoded rollouts, as a float32 array of shape [N].

    `kw` is passed through to `compute_score` (method, format_score, score). The lengths must
    match: a silently truncated zip would misalign rewards with rollouts.
    """
    if len(solutions) != len(ground_truths):
        raise ValueError(
            f"len(solutions)={len(solutions)} != len(ground_truths)={len(ground_truths)}"
        )
    return np.asarray(
        [compute_score(s, g, **kw) for s, g in zip(solutions, ground_truths, strict=True)],
        dtype=np.float32,
    ).reshape(len(solutions))

"""GSM8K reward: verl's exact semantics (verl/utils/reward_score/gsm8k.py), quirks included.

A hand-worked table (each expected value derived from the regexes, derivation in the comment),
Hypothesis properties on arbitrary text, and a cross-check against an independent re-statement
of verl's function on strings drawn from a number-heavy grammar. The same three for the boxed
reading (not verl's; aqn_jax/rewards.py says where it departs from verl's `math` reward).
"""

import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aqn_jax.rewards import (
    GSM8K_METHODS,
    METHODS,
    compute_score,
    extract_solution,
    normalize_answer,
    score_batch,
)


def _verl_reference(solution_str, method="strict", ground_truth=None, format_score=0.0, score=1.0):
    """verl's extract_solution (+ compute_score when ground_truth is given), restated as written.

    Kept deliberately close to verl's own control flow (assert, the `for ... break` loop whose
    variable leaks out) and independent of aqn_jax.rewards' helpers.
    """
    assert method in ["strict", "flexible"]
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        if len(solutions) == 0:
            final_answer = None
        else:
            final_answer = solutions[-1].replace(",", "").replace("$", "")
    else:
        answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
        final_answer = None
        if len(answer) == 0:
            pass
        else:
            invalid_str = ["", "."]
            for final_answer in reversed(answer):  # noqa: B007 (verl's leaking loop variable)
                if final_answer not in invalid_str:
                    break
    if ground_truth is None:
        return final_answer
    if final_answer is None:
        return 0
    return score if final_answer == ground_truth else format_score


def case(solution, ground_truth, method, extracted, expected, **kw):
    return pytest.param(solution, ground_truth, method, extracted, expected, kw)


# Columns: solution_str, ground_truth, method, expected extracted answer, expected score.
# Unless a row passes its own kwargs, format_score=0.0 and score=1.0 (verl's defaults).
# Strict regex: "#### (\-?[0-9\.\,]+)"; flexible regex: "(\-?[0-9\.\,]+)".
CASES = [
    # Commas are stripped in strict mode: group "1,234" -> "1234" == gt.
    case("The total is #### 1,234", "1234", "strict", "1234", 1.0),
    # Flexible: the only match is "1,234" ("####" has no digits); no stripping -> != "1234".
    case("The total is #### 1,234", "1234", "flexible", "1,234", 0.0),
    # Flexible keeps the comma, so a comma-formatted ground truth does match.
    case("It costs $1,234", "1,234", "flexible", "1,234", 1.0),
    # "$" right after "#### ": the group must start with "-" or [0-9.,]; "$" is neither -> None.
    case("#### $5", "5", "strict", None, 0.0),
    # Flexible on the same text: findall skips "#", " ", "$" and matches "5".
    case("#### $5", "5", "flexible", "5", 1.0),
    # "$" after the number just ends the group: "5".
    case("#### 5$", "5", "strict", "5", 1.0),
    # A later "#### $6" does not match at all, so the last MATCH is the earlier "5".
    case("#### 5 then #### $6", "5", "strict", "5", 1.0),
    # Negative: "-" then "17".
    case("#### -17", "-17", "strict", "-17", 1.0),
    # "--17": optional "-" takes the first "-", the second is not in [0-9.,] -> no match at all
    # (the literal "#### " occurs only once).
    case("#### --17", "-17", "strict", None, 0.0),
    # Flexible: at the first "-" the match fails; at the second "-" it matches "-17".
    case("#### --17", "-17", "flexible", "-17", 1.0),
    # "-,5": strict strips every comma -> "-5".
    case("#### -,5", "-5", "strict", "-5", 1.0),
    # "-0" is not "0" as a string.
    case("#### -0", "0", "strict", "-0", 0.0),
    # Decimals compare as strings: "3.50" != "3.5" -> format_score (0.1 here).
    case("#### 3.50", "3.5", "strict", "3.50", 0.1, format_score=0.1),
    case("#### 42.0", "42", "strict", "42.0", 0.0),
    # Dots are kept whatever their count.
    case("#### 1.2.3", "1.2.3", "strict", "1.2.3", 1.0),
    # Window: len 7 + 293 = 300 -> the whole string is examined -> "42".
    case("#### 42" + "x" * 293, "42", "strict", "42", 1.0),
    # len 7 + 294 = 301 -> s[-300:] starts at index 1: "### 42xxx" -> no "#### " -> None.
    case("#### 42" + "x" * 294, "42", "strict", None, 0.0),
    # Same text in flexible mode: "42" is still inside the window.
    case("#### 42" + "x" * 294, "42", "flexible", "42", 1.0),
    # len 7 + 299 = 306 -> window starts at index 6, the "2" of "42": flexible sees only "2".
    case("#### 42" + "x" * 299, "42", "flexible", "2", 0.0),
    # A "####" answer long before the window; the one at the end wins.
    case("#### 1" + "z" * 10_000 + "#### 2", "2", "strict", "2", 1.0),
    # Several "####": the LAST match wins (older verl took the first).
    case("#### 1\n#### 2\n#### 3", "3", "strict", "3", 1.0),
    case("#### 3 first, then #### 1", "3", "strict", "1", 0.0),
    case("#### 1,234 and #### 5,678", "5678", "strict", "5678", 1.0),
    # "#####": findall fails at index 0 ("#####" is not "#### ") and matches at index 1.
    case("##### 7", "7", "strict", "7", 1.0),
    # No answer at all.
    case("I do not know", "0", "strict", None, 0.0),
    # Flexible quirk: the only match is the final "." -> every match invalid -> verl's loop
    # variable is left at answer[0] == "." (not None) -> compared to "0" -> format_score.
    case("I do not know.", "0", "flexible", ".", 0.25, format_score=0.25),
    # The quirk scores full marks against a ground truth of ".": matches [".", "."].
    case("a . b .", ".", "flexible", ".", 1.0),
    # "...." is ONE match "...." (the class repeats), which is not in ("", ".") -> returned.
    case("wait....", "0", "flexible", "....", 0.0),
    # Strict has no "invalid" filter: "#### ." -> ".".
    case("#### .", ".", "strict", ".", 1.0),
    # Unicode digits are not [0-9]: Arabic-Indic three.
    case("#### ٣", "3", "strict", None, 0.0),
    case("#### ٣", "3", "flexible", None, 0.0),
    # Full-width digits.
    case("#### ４２", "42", "strict", None, 0.0),
    case("#### ４２", "42", "flexible", None, 0.0),
    # Mixed: ASCII "4" matches, "٣" ends the group -> "4" != "43".
    case("#### 4٣", "43", "strict", "4", 0.0),
    # Trailing text after the number is ignored in strict mode.
    case("#### 72 apples in total.", "72", "strict", "72", 1.0),
    # Flexible: matches ["72", "."] -> the trailing "." is skipped -> "72".
    case("#### 72 apples in total.", "72", "flexible", "72", 1.0),
    # "#### 1 2": the group stops at the space -> "1".
    case("#### 1 2", "12", "strict", "1", 0.0),
    # No space after "####" -> strict needs "#### " -> None; flexible finds "5".
    case("####5", "5", "strict", None, 0.0),
    case("####5", "5", "flexible", "5", 1.0),
    # Two spaces: after "#### " comes " " -> no match.
    case("####  5", "5", "strict", None, 0.0),
    # A non-breaking space is not " ".
    case("####\u00a05", "5", "strict", None, 0.0),
    # Flexible picks the last number.
    case("3 apples plus 4 apples is 7", "7", "flexible", "7", 1.0),
    # "42." is one match (the dot is in the class) -> "42." != "42".
    case("The answer is 42.", "42", "flexible", "42.", 0.0),
    # With a space the dot is its own match, skipped -> "42".
    case("The answer is 42 .", "42", "flexible", "42", 1.0),
    # "3-5": "3" then "-5" (the "-" starts the second match).
    case("x = 3-5", "-5", "flexible", "-5", 1.0),
    # "- 5": "-" needs a [0-9.,] right after it -> only "5" matches.
    case("x - 5", "5", "flexible", "5", 1.0),
    # Empty string.
    case("", "0", "strict", None, 0.0),
    case("", "0", "flexible", None, 0.0),
    # "#### -": "-" then nothing from [0-9.,] (the group needs at least one) -> None.
    case("#### -", "0", "strict", None, 0.0),
    case("#### -", "0", "flexible", None, 0.0),
    # "#### ,,,": the group is ",,," -> commas stripped -> "" -> equals an empty ground truth!
    case("#### ,,,", "", "strict", "", 1.0),
    case("#### ,,,", "0", "strict", "", 0.1, format_score=0.1),
    # Flexible keeps ",,," (not in ("", ".")).
    case("#### ,,,", "", "flexible", ",,,", 0.0),
    # score is honoured ...
    case("#### 7", "7", "strict", "7", 2.5, score=2.5),
    # ... format_score too when an answer is extracted but wrong ...
    case("#### 8", "7", "strict", "8", 0.1, format_score=0.1, score=2.5),
    # ... but not when nothing is extracted (verl returns 0).
    case("no answer here", "7", "strict", None, 0.0, format_score=0.1, score=2.5),
]


def test_table_is_big_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("solution,ground_truth,method,extracted,expected,kw", CASES)
def test_table(solution, ground_truth, method, extracted, expected, kw):
    assert extract_solution(solution, method) == extracted
    got = compute_score(solution, ground_truth, method=method, **kw)
    assert isinstance(got, float) and got == expected
    # The hand derivation agrees with the reference restatement too.
    assert _verl_reference(solution, method) == extracted
    assert _verl_reference(solution, method, ground_truth, **kw) == expected


def test_default_method_is_strict():
    assert extract_solution("####5") is None and compute_score("#### 5", "5") == 1.0


@pytest.mark.parametrize("method", ["lenient", "", "STRICT", None])
def test_invalid_method_raises_value_error(method):
    with pytest.raises(ValueError, match=r"method=.*strict.*flexible"):
        extract_solution("#### 5", method)
    with pytest.raises(ValueError, match="method"):
        compute_score("#### 5", "5", method=method)


def test_score_batch():
    got = score_batch(["#### 5", "#### 6", "nothing", "#### 5"], ["5", "5", "5", "5"])
    assert got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 1.0])
    got = score_batch(["#### 5", "#### 6", "6"], ["5", "5", "6"], format_score=0.5, score=2.0)
    np.testing.assert_array_equal(got, [2.0, 0.5, 0.0])
    got = score_batch(["6", "the sum is 6."], ["6", "6"], method="flexible")
    np.testing.assert_array_equal(got, [1.0, 0.0])
    empty = score_batch([], [])
    assert empty.dtype == np.float32 and empty.shape == (0,)


def test_score_batch_length_mismatch_names_both_lengths():
    with pytest.raises(ValueError, match=r"len\(solutions\)=3.*len\(ground_truths\)=2"):
        score_batch(["a", "b", "c"], ["1", "2"])


# --- properties ---------------------------------------------------------------------------------
# Long strings: concatenating a few copies of arbitrary text reaches several thousand characters.
long_text = st.builds(lambda s, k: s * k, st.text(max_size=400), st.integers(1, 40))
any_text = st.one_of(st.text(), long_text)


@settings(max_examples=300, deadline=None)
@given(any_text, st.sampled_from(GSM8K_METHODS))
def test_extract_never_raises_and_matches_reference(text, method):
    got = extract_solution(text, method)
    assert got is None or isinstance(got, str)
    assert got == _verl_reference(text, method)


@settings(max_examples=200, deadline=None)
@given(
    any_text,
    st.text(max_size=8),
    st.sampled_from(GSM8K_METHODS),
    st.floats(-10, 10, allow_nan=False),
    st.floats(-10, 10, allow_nan=False),
)
def test_compute_score_takes_one_of_three_values(text, gt, method, format_score, score):
    got = compute_score(text, gt, method=method, format_score=format_score, score=score)
    assert got in {0.0, format_score, score}
    assert got == _verl_reference(text, method, gt, format_score, score)


def _with_commas(n: int, flags: list[bool], thousands: bool) -> str:
    """str(n) with commas: either thousands separators or after the digits flagged True."""
    if thousands:
        return f"{n:,}"
    sign, digits = ("-", str(-n)) if n < 0 else ("", str(n))
    out = "".join(
        d + ("," if f and i < len(digits) - 1 else "")
        for i, (d, f) in enumerate(zip(digits, flags + [False] * len(digits), strict=False))
    )
    return sign + out


@settings(max_examples=300, deadline=None)
@given(
    any_text,
    st.integers(-(10**15), 10**15),
    st.lists(st.booleans(), max_size=20),
    st.booleans(),
)
def test_appended_answer_always_scores(prefix, n, flags, thousands):
    # Any strict match must start with "#### " and its number cannot contain "#", so nothing in
    # the prefix can swallow or follow the appended marker: it is always the last match, and the
    # suffix (< 300 chars) is always inside the window.
    suffix = "#### " + _with_commas(n, flags, thousands)
    assert extract_solution(prefix + suffix) == str(n)
    assert compute_score(prefix + suffix, str(n)) == 1.0


# --- grammar cross-check ------------------------------------------------------------------------
_TOKENS = (
    list("0123456789")
    + [",", ".", "$", "-", "####", "#### ", "#", " ", "  ", "\n"]
    + ["answer", "is", "apples", "total", "٣", "４"]
)


def _grammar_string(rng: random.Random) -> str:
    # Up to 300 tokens (~2 characters each), so many strings exceed the 300-character window.
    return "".join(rng.choice(_TOKENS) for _ in range(rng.randint(0, 300)))


def test_cross_check_against_reference_on_grammar_strings():
    rng = random.Random(0)
    n_long = n_found = 0
    for _ in range(2000):
        s = _grammar_string(rng)
        n_long += len(s) > 300
        for method in GSM8K_METHODS:
            ref = _verl_reference(s, method)
            assert extract_solution(s, method) == ref, (s, method)
            n_found += ref is not None
            # Ground truths that hit, miss, and near-miss the extracted answer.
            for gt in {ref or "", "5", (ref or "").replace(",", "")}:
                assert compute_score(s, gt, method, 0.5, 2.0) == _verl_reference(
                    s, method, gt, 0.5, 2.0
                )
    # The grammar really exercises the window and both outcomes.
    assert n_long > 500 and 2000 < n_found < 4000


# --- the boxed reading ---------------------------------------------------------------------------
BOXED_CASES = [
    # The last box wins over an earlier one and over a later "####".
    case(r"first \boxed{5}, then \boxed{7}", "7", "boxed", "7", 1.0),
    case(r"\boxed{7} #### 5", "7", "boxed", "7", 1.0),
    # No box: the strict reading ("####" plus exactly one space).
    case("so #### 1,234", "1234", "boxed", "1234", 1.0),
    case("so ####1234", "1234", "boxed", None, 0.0),
    # A box left open (token limit) is skipped for the earlier closed one.
    case(r"\boxed{12} and \boxed{13", "12", "boxed", "12", 1.0),
    # Open and nothing else: no answer at all, even with a "####" before it? No: strict reads it.
    case(r"#### 4 \boxed{13", "4", "boxed", "4", 1.0),
    # Nested braces are kept whole.
    case(r"\boxed{\frac{1}{2}}", "0.5", "boxed", r"\frac{1}{2}", 0.0),
    case(r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", "boxed", r"\frac{1}{2}", 1.0),
    # Dollars, escaped or not, and percent signs are dropped.
    case(r"\boxed{\$18}", "18", "boxed", "18", 1.0),
    case(r"\boxed{$18$}", "18", "boxed", "18", 1.0),
    case(r"\boxed{25\%}", "25", "boxed", "25", 1.0),
    case(r"\boxed{25%}", "25", "boxed", "25", 1.0),
    # Thousands commas (also LaTeX's {,}), but not a comma elsewhere.
    case(r"\boxed{1,234,567}", "1234567", "boxed", "1234567", 1.0),
    case(r"\boxed{1{,}000}", "1000", "boxed", "1000", 1.0),
    case(r"\boxed{1,23}", "123", "boxed", "1,23", 0.0),
    case(r"\boxed{3, 4}", "3", "boxed", "3, 4", 0.0),
    # A trailing "." and surrounding whitespace.
    case(r"\boxed{ 42. }", "42", "boxed", "42", 1.0),
    # A \text unit after the number; a \text that is the whole answer stays.
    case(r"\boxed{18 \text{ dollars}}", "18", "boxed", "18", 1.0),
    case(r"\boxed{18\mbox{km}}", "18", "boxed", "18", 1.0),
    case(r"\boxed{\text{yes}}", "yes", "boxed", r"\text{yes}", 0.0),
    # Numbers compare numerically (verl's string equality would give 0 for both).
    case(r"\boxed{3.50}", "3.5", "boxed", "3.50", 1.0),
    case(r"\boxed{42.0}", "42", "boxed", "42.0", 1.0),
    case(r"\boxed{-7}", "-7", "boxed", "-7", 1.0),
    case(r"\boxed{-7}", "7", "boxed", "-7", 0.0),
    # Not plain decimals: compared as strings ("1e2" is not 100; "inf" is not a number here).
    case(r"\boxed{1e2}", "100", "boxed", "1e2", 0.0),
    case(r"\boxed{inf}", "inf", "boxed", "inf", 1.0),
    # The ground truth is normalised too.
    case(r"\boxed{1234}", "1,234", "boxed", "1234", 1.0),
    # Scores: format_score for a wrong answer, 0 for none.
    case(r"\boxed{8}", "7", "boxed", "8", 0.25, format_score=0.25, score=2.0),
    case(r"\boxed{7}", "7", "boxed", "7", 2.0, format_score=0.25, score=2.0),
    case(r"\boxed{}", "7", "boxed", "", 0.25, format_score=0.25, score=2.0),
    case("no answer", "7", "boxed", None, 0.0, format_score=0.25, score=2.0),
]


@pytest.mark.parametrize("solution,ground_truth,method,extracted,expected,kw", BOXED_CASES)
def test_boxed_table(solution, ground_truth, method, extracted, expected, kw):
    assert extract_solution(solution, method) == extracted
    got = compute_score(solution, ground_truth, method=method, **kw)
    assert isinstance(got, float) and got == expected


def test_boxed_is_a_method_and_the_gsm8k_methods_are_verls():
    # verl's two readings come first, bit for bit; boxed is ours.
    assert METHODS.names() == (*GSM8K_METHODS, "boxed") and GSM8K_METHODS == ("strict", "flexible")
    # Negative control: the strict and flexible readings of the same boxed answer.
    assert compute_score(r"\boxed{1,234}", "1234", "strict") == 0.0
    assert compute_score(r"\boxed{1,234}", "1234", "flexible") == 0.0
    assert compute_score(r"\boxed{1,234}", "1234", "boxed") == 1.0


def _box_reference(s: str) -> str | None:
    """An independent statement of the boxed reading: one left-to-right pass with a stack of
    open braces; the completed box that starts last wins; else verl's strict regex."""
    stack, done, i = [], [], 0
    while i < len(s):
        if s.startswith("\\boxed{", i):
            stack.append(("box", i + 7))
            i += 7
            continue
        if s[i] == "{":
            stack.append(("brace", i))
        elif s[i] == "}" and stack:
            kind, start = stack.pop()
            if kind == "box":
                done.append((start, s[start:i]))
        i += 1
    if done:
        answer = max(done)[1]
    else:
        found = re.findall("#### (\\-?[0-9\\.\\,]+)", s[-300:])
        if not found:
            return None
        answer = found[-1].replace(",", "")
    prev = None
    while answer != prev:
        prev, a = answer, answer.strip()
        a = re.sub(r"^(.*\d)\s*\\(text|mbox|mathrm)\{[^{}]*\}$", r"\1", a)
        a = re.sub(r"\\?[$%]", "", a).replace("{,}", ",").strip()
        a = a[:-1].rstrip() if a.endswith(".") else a
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", a):
            a = a.replace(",", "")
        answer = a
    return answer


_BOX_TOKENS = [
    *"0123456789",
    *[",", ".", "-", " ", "{", "}", "{,}", "$", "\\$", "%", "\\%", "####", "#### "],
    *["\\boxed{", "\\boxed{", "\\text{ apples}", "\\frac{", "answer", "\n"],
]


def test_boxed_cross_check_on_grammar_strings():
    rng = random.Random(1)
    n_box = n_found = n_hit = 0
    for _ in range(2000):
        s = "".join(rng.choice(_BOX_TOKENS) for _ in range(rng.randint(0, 120)))
        ref = _box_reference(s)
        assert extract_solution(s, "boxed") == ref, s
        assert ref is None or normalize_answer(ref) == ref  # a fixed point
        n_box += "\\boxed{" in s
        n_found += ref is not None
        for gt in {ref or "", "5"}:
            got = compute_score(s, gt, "boxed", 0.5, 2.0)
            assert got in {0.0, 0.5, 2.0}
            assert (got == 2.0) == (
                ref is not None
                and normalize_answer(gt) == ref
                or (
                    ref is not None
                    and re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", ref) is not None
                    and re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", normalize_answer(gt)) is not None
                    and float(ref) == float(normalize_answer(gt))
                )
            ), (s, gt)
            n_hit += got == 2.0
    # Every path is exercised: boxes, no boxes, answers read, hits.
    assert n_box > 1000 and 1000 < n_found < 2000 and n_hit > 1000


def _formatted(n: int, rng: random.Random) -> str:
    """str(n) written as a model writes it in a box: signs, commas, units, dots, spaces."""
    body = rng.choice([f"{n}", f"{n:,}", f"{n:,}".replace(",", "{,}"), f"{n}.0", f"{n}.00"])
    body = rng.choice(["", "\\$", "$"]) + body
    body += rng.choice(["", "\\%", "%", " \\text{ dollars}", "\\text{cm}", "."])
    return rng.choice(["", " "]) + body + rng.choice(["", " "])


def test_boxed_generated_answers_score_and_a_wrong_one_does_not():
    """800 generated completions: prose, maybe an earlier box or a `####`, then the boxed answer
    in one of many spellings; it scores against str(n), and str(n + 1) is a negative control."""
    rng = random.Random(2)
    prose = ["Step 1: 3 + 4 = 7.", "We get $1,200 per month.", "So #### 99 was wrong.", ""]
    for _ in range(800):
        n = rng.choice([rng.randint(-50, 50), rng.randint(1000, 10**7)])
        s = rng.choice(prose) + rng.choice(["", "\\boxed{13} ", "#### 5 "])
        s += "Final: \\boxed{" + _formatted(n, rng) + "}" + rng.choice(["", ".", " \\boxed{9"])
        assert compute_score(s, str(n), "boxed") == 1.0, s
        assert compute_score(s, str(n + 1), "boxed") == 0.0, s
        assert compute_score(s, str(n), "strict") == 0.0 or "#### " in s

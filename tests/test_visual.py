"""Synthetic visual tasks (rlvr.data.visual) and the vision-language rewards (rlvr.rewards.visual).

Each family's answer is checked against the image's own pixels, not against the generator's
bookkeeping: shapes of one colour are counted as connected regions, a box against the extent of
its colour, sizes by area."""

from __future__ import annotations

import random

import io

import numpy as np
import pytest
from PIL import Image

from rlvr.data.visual import COLOURS, VISUAL_TASKS, visual_examples
from rlvr.rewards import REWARDS
from rlvr.rewards.visual import box_iou, chosen_letter, iou_reward, multiple_choice_reward, parse_boxes


def colour_mask(image: Image.Image, colour: str) -> np.ndarray:
    return (np.asarray(image) == np.array(COLOURS[colour], dtype=np.uint8)).all(-1)


def regions(mask: np.ndarray) -> int:
    """Connected regions (4-neighbour) of a boolean mask, by flood fill."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_examples_are_reproducible_and_differ_between_seeds() -> None:
    a, b = visual_examples("mixed", size=12, seed=3), visual_examples("mixed", size=12, seed=3)
    assert [(x.prompt, x.answer, x.id) for x in a] == [(x.prompt, x.answer, x.id) for x in b]
    assert [png(x.fields["images"][0]) for x in a] == [png(x.fields["images"][0]) for x in b]
    c = visual_examples("mixed", size=12, seed=4)
    assert [png(x.fields["images"][0]) for x in a] != [png(x.fields["images"][0]) for x in c]
    assert {x.fields["task"] for x in visual_examples("mixed", size=40, seed=0)} == set(VISUAL_TASKS)


def test_count_answers_are_the_regions_of_that_colour() -> None:
    examples = visual_examples("count", size=30, seed=0)
    answers = []
    for ex in examples:
        colour = ex.fields["colour"]
        assert colour in ex.prompt
        assert regions(colour_mask(ex.fields["images"][0], colour)) == int(ex.answer)  # type: ignore[arg-type]
        answers.append(int(ex.answer))  # type: ignore[arg-type]
    assert 0 in answers and max(answers) >= 2
    # no answer a policy could give blind scores much (the commonest about a third), "0" the fewest
    many = [ex.answer for ex in visual_examples("count", size=400, seed=5)]
    assert max(many.count(a) for a in set(many)) / len(many) < 0.4 and many.count("0") / len(many) < 0.15


def test_locate_boxes_are_the_extent_of_the_target() -> None:
    for ex in visual_examples("locate", size=30, seed=1):
        x1, y1, x2, y2 = ex.fields["box"]
        colour = ex.fields["target"].split()[0]
        inside = colour_mask(ex.fields["images"][0], colour)[y1:y2, x1:x2]
        ys, xs = np.nonzero(inside)
        # the target fills its box: circle, square and triangle all touch its four sides
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (0, 0, x2 - x1, y2 - y1)
        assert iou_reward(ex.prompt, f"<answer>{ex.answer}</answer>", **ex.fields) == 1.0


def test_compare_answers_the_larger_area() -> None:
    examples = visual_examples("compare", size=30, seed=2)
    for ex in examples:
        image, choices = ex.fields["images"][0], ex.fields["choices"]
        area = {k: int(colour_mask(image, v.split()[1]).sum()) for k, v in choices.items()}
        assert max(area, key=area.__getitem__) == ex.answer and min(area.values()) > 0
    assert {ex.answer for ex in examples} == {"A", "B"}


def test_digits_are_drawn_and_of_the_asked_length() -> None:
    for ex in visual_examples("digits", size=10, seed=0, params={"min_length": 3, "max_length": 3}):
        assert ex.answer is not None and len(ex.answer) == 3 and ex.answer.isdigit() and ex.answer[0] != "0"
        assert (np.asarray(ex.fields["images"][0]) < 64).all(-1).sum() > 20  # dark text pixels


def test_bad_task_parameters_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown visual task 'colour'"):
        visual_examples("colour", size=1)
    with pytest.raises(ValueError, match="could not place 40 shapes"):
        visual_examples("count", size=1, params={"min_shapes": 40, "max_shapes": 40, "width": 48, "height": 48})
    with pytest.raises(ValueError, match="min_difference"):
        visual_examples("compare", size=1, params={"min_side": 10, "max_side": 12})


def test_box_iou_by_hand() -> None:
    assert box_iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(50 / 150)
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([0, 0, 0, 10], [0, 0, 0, 10]) == 0.0  # no area: no credit, not 0/0


def test_boxes_are_parsed_in_the_layouts_models_write() -> None:
    want = [(10.0, 20.0, 30.0, 40.0)]
    for text in ["[10, 20, 30, 40]", "10 20 30 40", "(10, 20), (30, 40)", "[30, 40, 10, 20]", "[10.0,20.0,30.0,40.0]",
                 '{"bbox_2d": [10, 20, 30, 40]}']:
        assert parse_boxes(text) == want, text
    assert parse_boxes("[1e999, 2, 3, 4]") == [] and parse_boxes("no box") == []


def test_iou_reward_scores_one_box_and_refuses_hedges() -> None:
    gold = {"box": [10, 10, 20, 20], "image_size": [100, 100]}
    assert iou_reward("", "The box is [15, 10, 25, 20].", **gold) == pytest.approx(50 / 150)
    assert iou_reward("", "<answer>[15, 10, 25, 20]</answer>", **gold, threshold=0.5) == 0.0
    assert iou_reward("", "<answer>[11, 10, 20, 20]</answer>", **gold, threshold=0.5) == 1.0
    assert iou_reward("", "[0.1, 0.1, 0.2, 0.2]", **gold) == pytest.approx(1.0)  # normalised, scaled by the size
    assert iou_reward("", "[0.1, 0.1, 0.2, 0.2]", **gold, coordinates="pixels") == 0.0
    # the answer tag wins over boxes in the reasoning; several boxes, or none, are no answer
    assert iou_reward("", "first [0, 0, 5, 5] <answer>[10, 10, 20, 20]</answer>", **gold) == 1.0
    assert iou_reward("", "<answer>[10, 10, 20, 20] or [0, 0, 99, 99]</answer>", **gold) == 0.0
    assert iou_reward("", "[10, 10, 20, 20] [30, 30, 40, 40]", **gold) == 0.0
    assert iou_reward("", "I cannot see it", **gold) == 0.0
    assert iou_reward("", "<answer>[0, 0, 100, 100]</answer>", **gold) == pytest.approx(0.01)  # the whole image
    assert iou_reward("", "[10, 10, 20, 20]", answer="[10, 10, 20, 20]") == 1.0  # the reference in the answer
    assert iou_reward("", "[10, 10, 20, 20]", box=[20, 20, 10, 10]) == 1.0  # a reference's corners put in order
    # a reference in [0, 1] is compared as it is, whatever `coordinates` says
    assert iou_reward("", "[0.1, 0.1, 0.2, 0.2]", box=[0.1, 0.1, 0.2, 0.2], coordinates="normalized") == 1.0
    with pytest.raises(ValueError, match="threshold must be in"):
        iou_reward("", "[10, 10, 20, 20]", **gold, threshold=0.0)
    with pytest.raises(ValueError, match="needs the reference box"):
        iou_reward("", "[1, 2, 3, 4]", answer="unknown")


def test_multiple_choice_reads_one_letter_and_refuses_hedges() -> None:
    options = {"A": "the red one", "B": "the green one"}
    chose = {"B": "B", "<answer>B</answer>": "B", "<answer>(b)</answer>": "B", "The answer is (B).": "B",
             "<answer>(B) the green one</answer>": "B", "<answer>the green one</answer>": "B",
             "answer is A. No wait, the answer is B": "B", "Answer: A": "A",
             "<answer>A or B</answer>": None, "A or B": None, "<answer>(A) the green one</answer>": None,
             "The answer is a red one": None, "<answer>C</answer>": None, "": None,
             "The answer is A, because option B is smaller.": "A", "The answer is A or B": None,
             "Answer: A/B": None, "answer: A, B, C, D or E": None, "The answer I pick is B": "B",
             "Final Answer: **B**": "B", "The answer is A, a red one": "A"}
    for text, letter in chose.items():
        assert chosen_letter(text, options) == letter, text
        assert multiple_choice_reward("", text, answer="B", choices=options) == float(letter == "B")
    assert multiple_choice_reward("", "<answer>C</answer>", answer="C") == 1.0  # A–E without choices
    assert multiple_choice_reward("", "B", answer="B", choices=["x", "y"]) == 1.0
    with pytest.raises(ValueError, match="not one of the options"):
        multiple_choice_reward("", "A", answer="Z", choices=options)


def test_exact_answers_compare_numbers_without_their_commas() -> None:
    from rlvr.rewards.visual import exact_answer_reward

    for text in ["<answer>1,234</answer>", "it is 1,234", "<answer> 1234 </answer>"]:
        assert exact_answer_reward("", text, answer="1234") == 1.0, text
    assert exact_answer_reward("", "<answer>12,34</answer>", answer="1234") == 0.0  # not a thousands comma
    assert exact_answer_reward("", "maybe 1234 or 1235", answer="1234") == 0.0  # the last number answers
    assert exact_answer_reward("", "<answer>0407</answer>", answer="407") == 0.0  # a digit string is text


def test_the_visual_rewards_are_built_in_and_score_their_families() -> None:
    assert {"iou", "multiple_choice", "exact_answer"} <= set(REWARDS)
    for family, reward, reply in [("count", "exact_answer", "There are {answer}."),
                                  ("digits", "exact_answer", "<answer>{answer}</answer>"),
                                  ("locate", "iou", "<answer>{answer}</answer>"),
                                  ("compare", "multiple_choice", "The answer is {answer}.")]:
        for ex in visual_examples(family, size=5, seed=0):
            assert REWARDS[reward](ex.prompt, reply.format(answer=ex.answer), **ex.fields) == 1.0


def test_two_large_shapes_always_find_room() -> None:
    """A first square in the middle of the image can leave no room for a second one of the same
    size; the layout starts over instead of failing (compare's defaults hit this about once in
    a few thousand examples)."""
    from rlvr.data.visual import place

    for seed in range(300):
        a, b = place(random.Random(seed), [48, 48], 128, 128)
        assert a[2] + 2 <= b[0] or b[2] + 2 <= a[0] or a[3] + 2 <= b[1] or b[3] + 2 <= a[1]


def test_parsing_boxes_stays_linear_on_runs_of_blank_lines() -> None:
    """Three numbers with 200-line gaps took ~30 s to search (an ambiguous separator backtracked;
    found by a red-team review, session 19): now microseconds. The bound is 100x the ordinary."""
    import time

    degenerate = ("1\n" + "\n" * 200 + "2\n" + "\n" * 200 + "3\n" + "\n" * 200 + "done") * 3
    start = time.perf_counter()
    assert parse_boxes(degenerate) == []
    assert time.perf_counter() - start < 2.0
    assert parse_boxes("10 ,20 ;30\n40") == [(10.0, 20.0, 30.0, 40.0)]


def test_a_right_answer_in_markdown_latex_or_with_a_unit_is_read_and_a_hedge_is_not() -> None:
    """Found scored 0 by a red-team review (session 19)."""
    from rlvr.rewards.visual import exact_answer_reward

    for answer in ("12.", "**12**", "$12$", r"\boxed{12}", "12.0", "12 apples", "`12`"):
        assert exact_answer_reward("", f"<answer>{answer}</answer>", answer="12") == 1.0, answer
    for answer in ("12 or 13", "13", "12 13", "-12", "120", "not 12", "at least 12", "12 or more", "12 or thirteen"):
        assert exact_answer_reward("", f"<answer>{answer}</answer>", answer="12") == 0.0, answer
    assert exact_answer_reward("", "<answer>Gemini 11</answer>", answer="Apollo 11") == 0.0
    assert exact_answer_reward("", "<answer>$12</answer>", answer="12") == 1.0
    assert exact_answer_reward("", "<answer>7</answer>", answer="007") == 0.0  # a digit string stays text
    for completion in (r"\boxed{B}", r"$\boxed{B}$", "**B**", "<answer>**B**</answer>", "<answer>Option B</answer>",
                       "The correct option is B.", "Answer: B (the one that is D-shaped)",
                       "Answer: B, which is C's mirror image"):
        assert multiple_choice_reward("", completion, answer="B") == 1.0, completion
    for completion in (r"\boxed{A} \boxed{B}", "<answer>**A or B**</answer>", "The answer is A or B"):
        assert multiple_choice_reward("", completion, answer="B") == 0.0, completion

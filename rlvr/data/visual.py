"""Synthetic visual tasks, drawn in-process with PIL: prompts that carry an image, with answers a
program can check, so that vision-language RL runs (and is tested) with nothing from a hub.

Four families, each a function of (random generator, params) -> (image, question, answer, fields):

    count    "How many red shapes are in the image?"                 -> "3"
    locate   "Give the bounding box of the blue circle ..."           -> "[x1, y1, x2, y2]" (pixels)
    compare  "Which shape is larger? (A) the red one (B) the green"   -> "A" (multiple choice)
    digits   "What number is written in the image?"                   -> "4071"

The answers follow the checks of rlvr.rewards.visual: `count` and `digits` are exact answers
(reasoning-gym style: the last number or the <answer> tag), `locate` is scored by IoU against
``fields["box"]`` (Visual-RFT's grounding reward) and `compare` by multiple-choice match.
Each example's image is ``fields["images"]``, a list of PIL images, where a VLM's processor
finds it (the same key a dataset row's image column becomes).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from rlvr.data.tasks import Example

COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
                                            "yellow": (230, 200, 30)}
KINDS = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)

Box = tuple[int, int, int, int]
"""(x1, y1, x2, y2) in pixels, x2 and y2 exclusive."""


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: Box, colour: tuple[int, int, int]) -> None:
    x1, y1, x2, y2 = box
    if kind == "circle":
        draw.ellipse((x1, y1, x2 - 1, y2 - 1), fill=colour)
    elif kind == "square":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=colour)
    elif kind == "triangle":
        draw.polygon([((x1 + x2 - 1) / 2, y1), (x1, y2 - 1), (x2 - 1, y2 - 1)], fill=colour)
    else:
        raise ValueError(f"unknown shape {kind!r} (one of {', '.join(KINDS)})")


def place(rng: random.Random, sizes: list[int], width: int, height: int, gap: int = 2,
          tries: int = 200, layouts: int = 20) -> list[Box]:
    """Non-overlapping square boxes of the given sides inside a width × height canvas (at least
    `gap` pixels apart), by rejection sampling; a ValueError when they do not fit. A layout whose
    first boxes leave no room for the next (a large square in the middle) starts over, up to
    ``layouts`` times."""
    for side in sizes:
        if side > min(width, height):
            raise ValueError(f"a shape of side {side} does not fit a {width}x{height} image")
    for _ in range(layouts):
        boxes: list[Box] = []
        for side in sizes:
            for _ in range(tries):
                x, y = rng.randrange(0, width - side + 1), rng.randrange(0, height - side + 1)
                box = (x, y, x + side, y + side)
                if all(box[2] + gap <= b[0] or b[2] + gap <= box[0] or box[3] + gap <= b[1] or b[3] + gap <= box[1]
                       for b in boxes):
                    boxes.append(box)
                    break
            else:
                break
        if len(boxes) == len(sizes):
            return boxes
    raise ValueError(f"could not place {len(sizes)} shapes in a {width}x{height} image: "
                     "use fewer or smaller shapes, or a larger image")


def _canvas(params: dict[str, Any]) -> tuple[Image.Image, ImageDraw.ImageDraw, int, int]:
    width, height = int(params.get("width", 128)), int(params.get("height", 128))
    image = Image.new("RGB", (width, height), BACKGROUND)
    return image, ImageDraw.Draw(image), width, height


def count_task(rng: random.Random, params: dict[str, Any]) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """Shapes of random colours and kinds; how many are of one colour (0 included)."""
    image, draw, width, height = _canvas(params)
    n = rng.randint(int(params.get("min_shapes", 2)), int(params.get("max_shapes", 8)))
    side_low, side_high = int(params.get("min_side", 12)), int(params.get("max_side", 24))
    boxes = place(rng, [rng.randint(side_low, side_high) for _ in range(n)], width, height)
    colours = [rng.choice(list(COLOURS)) for _ in boxes]
    for box, colour in zip(boxes, colours):
        draw_shape(draw, rng.choice(KINDS), box, COLOURS[colour])
    # mostly a colour that is there, so that "0" is a minority answer (about 8%), not a blind guess
    asked = rng.choice(colours) if rng.random() < 0.75 else rng.choice(list(COLOURS))
    count = colours.count(asked)
    return image, f"How many {asked} shapes are in the image?", str(count), {"colour": asked, "count": count}


def locate_task(rng: random.Random, params: dict[str, Any]) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """One target (the only shape of its colour and kind) among distractors; its bounding box."""
    image, draw, width, height = _canvas(params)
    distractors = rng.randint(int(params.get("min_distractors", 0)), int(params.get("max_distractors", 3)))
    side_low, side_high = int(params.get("min_side", 16)), int(params.get("max_side", 40))
    boxes = place(rng, [rng.randint(side_low, side_high) for _ in range(distractors + 1)], width, height)
    target = (rng.choice(list(COLOURS)), rng.choice(KINDS))
    draw_shape(draw, target[1], boxes[0], COLOURS[target[0]])
    others = [(c, k) for c in COLOURS for k in KINDS if (c, k) != target]
    for box in boxes[1:]:
        colour, kind = rng.choice(others)
        draw_shape(draw, kind, box, COLOURS[colour])
    target_box = list(boxes[0])
    question = (f"Give the bounding box of the {target[0]} {target[1]} in the {width}x{height} image, "
                "in pixels, as [x1, y1, x2, y2].")
    fields = {"box": target_box, "image_size": [width, height], "target": " ".join(target)}
    return image, question, str(target_box), fields


def compare_task(rng: random.Random, params: dict[str, Any]) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """Two shapes of one kind, different colours and sizes; which is larger, as a multiple choice
    (one kind, so that the larger side is the larger area)."""
    image, draw, width, height = _canvas(params)
    side_low, side_high = int(params.get("min_side", 10)), int(params.get("max_side", 48))
    difference = int(params.get("min_difference", 6))
    if side_high - side_low < difference or difference < 1:
        raise ValueError(f"compare needs max_side - min_side >= min_difference >= 1 (got {side_low}, {side_high}, "
                         f"{difference})")
    small = rng.randint(side_low, side_high - difference)
    large = rng.randint(small + difference, side_high)
    colours = rng.sample(list(COLOURS), 2)
    sides = [small, large] if rng.random() < 0.5 else [large, small]
    kind = rng.choice(KINDS)
    for box, colour in zip(place(rng, sides, width, height), colours):
        draw_shape(draw, kind, box, COLOURS[colour])
    answer = "A" if sides[0] > sides[1] else "B"
    choices = {"A": f"the {colours[0]} one", "B": f"the {colours[1]} one"}
    question = (f"Which shape is larger? (A) {choices['A']} (B) {choices['B']}. Answer with the letter.")
    return image, question, answer, {"choices": choices}


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):  # a Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def digits_task(rng: random.Random, params: dict[str, Any]) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """A string of digits drawn in black at a random place; read it back."""
    image, draw, width, height = _canvas(params)
    length = rng.randint(int(params.get("min_length", 2)), int(params.get("max_length", 4)))
    text = str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(length - 1))
    font = _font(int(params.get("font_size", 24)))
    x1, y1, x2, y2 = (int(v) for v in draw.textbbox((0, 0), text, font=font))
    if x2 - x1 > width or y2 - y1 > height:
        raise ValueError(f"{length} digits at font size {params.get('font_size', 24)} do not fit "
                         f"a {width}x{height} image")
    x = rng.randint(0, width - (x2 - x1)) - x1
    y = rng.randint(0, height - (y2 - y1)) - y1
    draw.text((x, y), text, fill=(0, 0, 0), font=font)
    return image, "What number is written in the image?", text, {}


VISUAL_TASKS: dict[str, Callable[[random.Random, dict[str, Any]], tuple[Image.Image, str, str, dict[str, Any]]]] = {
    "count": count_task,
    "locate": locate_task,
    "compare": compare_task,
    "digits": digits_task,
}
"""The synthetic visual task families, by name."""

REWARD_OF: dict[str, str] = {"count": "exact_answer", "locate": "iou", "compare": "multiple_choice",
                             "digits": "exact_answer"}
"""How each family's answer is checked (the built-in reward that scores it)."""


PARAMS = {"width", "height", "min_shapes", "max_shapes", "min_side", "max_side", "min_distractors", "max_distractors",
          "min_difference", "min_length", "max_length", "font_size"}
"""The keys of ``params`` the families read."""


def visual_examples(task: str, *, size: int, seed: int = 0, params: dict[str, Any] | None = None,
                    instruction: str = "") -> list[Example]:
    """``size`` examples of a synthetic visual task family (a name in VISUAL_TASKS; ``"mixed"``
    draws the family of each example at random), reproducible from ``seed``. Each example's
    ``fields`` hold its image (``images``: a one-element list), the family (``task``), the answer
    and the family's own fields (a box, the choices)."""
    families = list(VISUAL_TASKS) if task == "mixed" else [task]
    if any(f not in VISUAL_TASKS for f in families):
        raise ValueError(f"unknown visual task {task!r}: one of {', '.join([*VISUAL_TASKS, 'mixed'])}")
    params = dict(params or {})
    unknown = sorted(set(params) - PARAMS)
    if unknown:
        raise ValueError(f"unknown visual task parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(PARAMS))}")
    out = []
    for i in range(size):
        rng = random.Random(f"{task}/{seed}/{i}")  # str seeds hash deterministically (SHA-512)
        family = rng.choice(families)
        try:
            image, question, answer, extra = VISUAL_TASKS[family](rng, params)
        except ValueError as err:
            if "randrange" not in str(err):
                raise
            raise ValueError(f"visual task {family!r}: a min_*/max_* pair of {params} is empty (min above max, with "
                             f"the family's defaults for the ones not given; docs/vlm.md lists them)") from None
        prompt = f"{question} {instruction}".strip()
        fields = {"task": family, "answer": answer, "images": [image], **extra}
        out.append(Example(prompt=prompt, answer=answer, fields=fields, id=f"visual/{task}/{seed}/{i}"))
    return out

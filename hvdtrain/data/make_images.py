"""A class-per-folder JPEG data set drawn procedurally, with no download
(``hvdtrain data make-images DIR``): ten shapes of random size, colour and position on a noisy
background. Every image is drawn from ``(seed, split, index)``, so the same options write the same
files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hvdtrain.errors import HvdtrainError

if TYPE_CHECKING:
    from PIL.ImageDraw import ImageDraw  # imported when images are made, not with the package

Box = tuple[float, float, float, float]


def _polygon(points: list[tuple[float, float]]) -> Callable[[ImageDraw, Box, tuple], None]:
    """A shape drawn as a polygon given in the unit square, scaled into the box."""
    def draw(canvas: ImageDraw, box: Box, colour: tuple) -> None:
        x0, y0, x1, y1 = box
        corners = [(x0 + px * (x1 - x0), y0 + py * (y1 - y0)) for px, py in points]
        canvas.polygon(corners, fill=colour)
    return draw


def _ring(canvas: ImageDraw, box: Box, colour: tuple) -> None:
    width = max(1, round((box[2] - box[0]) / 5))
    canvas.ellipse(box, outline=colour, width=width)


def _cross(canvas: ImageDraw, box: Box, colour: tuple) -> None:
    x0, y0, x1, y1 = box
    w, h = (x1 - x0) / 3, (y1 - y0) / 3
    canvas.rectangle((x0 + w, y0, x1 - w, y1), fill=colour)
    canvas.rectangle((x0, y0 + h, x1, y1 - h), fill=colour)


SHAPES: dict[str, Callable[[ImageDraw, Box, tuple], None]] = {
    "circle": lambda canvas, box, colour: canvas.ellipse(box, fill=colour),
    "square": lambda canvas, box, colour: canvas.rectangle(box, fill=colour),
    "triangle": _polygon([(0.5, 0), (1, 1), (0, 1)]),
    "diamond": _polygon([(0.5, 0), (1, 0.5), (0.5, 1), (0, 0.5)]),
    "cross": _cross,
    "ring": _ring,
    "hbar": _polygon([(0, 0.35), (1, 0.35), (1, 0.65), (0, 0.65)]),
    "vbar": _polygon([(0.35, 0), (0.65, 0), (0.65, 1), (0.35, 1)]),
    "arrow": _polygon([(0, 0.3), (0.55, 0.3), (0.55, 0), (1, 0.5), (0.55, 1), (0.55, 0.7),
                       (0, 0.7)]),
    "hourglass": _polygon([(0, 0), (1, 0), (0, 1), (1, 1)]),
}
"""The ten classes; their folder names, sorted, give the labels."""


def draw_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One RGB image (size, size, 3) uint8 of class ``label``."""
    from PIL import Image, ImageDraw

    background = rng.integers(0, 256, size=3)
    noise = rng.normal(0, 16, size=(size, size, 3))
    pixels = np.clip(background + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    extent = rng.uniform(0.5, 0.95) * size
    x0, y0 = rng.uniform(0, size - extent, size=2)
    # The shape's colour is kept far from the background's, so the shape always shows.
    colour = tuple(int(c) for c in (background + 128 + rng.integers(-40, 41, size=3)) % 256)
    SHAPES[list(SHAPES)[label]](ImageDraw.Draw(image), (x0, y0, x0 + extent, y0 + extent), colour)
    return np.asarray(image)


def make_images(root: str | Path, train: int, test: int, size: int, seed: int = 0) -> Path:
    """Writes ``root/{train,test}/<class>/<index>.jpg``: ``train`` and ``test`` images in all,
    classes taking turns; returns ``root``. An existing non-empty ``root`` is an error."""
    from PIL import Image

    for name, value in (("--train", train), ("--test", test), ("--size", size)):
        if value < 1:
            raise HvdtrainError(f"data make-images {name}={value}: expected a positive integer")
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise HvdtrainError(f"data make-images: {root} exists and is not empty")
    names = list(SHAPES)
    for split_no, (split, count) in enumerate((("train", train), ("test", test))):
        for name in names:
            (root / split / name).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            label = index % len(names)
            rng = np.random.default_rng([seed, split_no, index])
            Image.fromarray(draw_image(label, size, rng)).save(
                root / split / names[label] / f"{index:06d}.jpg", quality=90)
    return root

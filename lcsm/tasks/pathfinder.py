"""Pathfinder (Linsley et al. 2018) as in the Long Range Arena (Tay et al. 2020, section 3.4):
are the two dots of an image connected by one dashed contour? Our own renderer of the images.

An image (side S; LRA: 32, Path-X 128) holds ``contours`` dashed curves of ``contour_length``
unit steps, each a random walk whose heading turns by at most ``max_turn`` degrees per step (the
smooth "snakes" of Linsley et al.; longer contours are their harder settings), drawn as dashes of
``dash`` pixels separated by gaps of ``gap`` pixels. Two 3x3 dots mark contour ends: both ends
of one contour (label 1) or one end each of two contours (label 0); the remaining contours are
distractors, so both classes show the same number of contours. Classes alternate (balanced).
Contours keep a Chebyshev distance of at least ``gap + 2`` from each other and ``gap + 4`` around
their ends (where the 3x3 dots go), so two lit pixels are on the same contour exactly when a chain
of lit pixels at most ``gap + 1`` apart joins them: the label is what a gap-tolerant flood fill of
the image says (tested).
Linsley et al. let contours cross; keeping them apart is our simplification, which makes the
label a property of the picture alone.

Pixels are 0 (background) or 255 (ink); the image is flattened row-major into S * S tokens of a
256-symbol vocabulary, as LRA feeds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import torch

from .base import Segment, Task, TaskConfig, Uniforms, check_int, register

_SPLIT_CODE = {"train": 0, "validation": 1, "test": 2}
INK = 255
Point = Tuple[int, int]


class _Retry(Exception):
    pass


def _shape(u: Uniforms, length: int, max_turn: float) -> np.ndarray:
    """A smooth random walk of ``length`` unit steps from the origin, [length + 1, 2] (row, col)."""
    heading = u() * 2 * math.pi
    turns = np.array([(2 * u() - 1) for _ in range(length)]) * math.radians(max_turn)
    angles = heading + np.cumsum(turns)
    steps = np.stack([np.sin(angles), np.cos(angles)], 1)
    return np.concatenate([np.zeros((1, 2)), np.cumsum(steps, 0)])


def _place(u: Uniforms, shape: np.ndarray, side: int) -> np.ndarray:
    """The walk's pixels [n, 2] at a uniform position where it fits inside a 2-pixel margin
    (drawing the shape first and moving it: a walk started at a random point would mostly leave
    the image)."""
    low, high = shape.min(0), shape.max(0)
    room = (side - 5) - (high - low)
    if (room < 0).any():
        raise _Retry
    pixels = np.rint(shape + (2 - low + np.array([u(), u()]) * room)).astype(np.int64)
    keep = np.ones(len(pixels), dtype=bool)
    keep[1:] = (pixels[1:] != pixels[:-1]).any(1)
    return pixels[keep]


def _dashed(points: List[Point], dash: int, gap: int) -> List[Point]:
    return [p for i, p in enumerate(points) if i % (dash + gap) < dash]


def _forbid(mask: np.ndarray, pixels: np.ndarray, distance: int) -> None:
    """Mark every pixel within Chebyshev ``distance`` - 1 of ``pixels`` in ``mask``."""
    d = distance - 1
    for r, col in pixels.tolist():
        mask[max(r - d, 0):r + d + 1, max(col - d, 0):col + d + 1] = True


def render(u: Uniforms, c: "PathfinderConfig", positive: bool) -> Tuple[np.ndarray, np.ndarray, List[Point]]:
    """(image [S, S] uint8, contour id map [S, S] int8 (-1 = background), the two dot centres)."""
    for _ in range(100):
        try:
            paths: List[np.ndarray] = []
            # near: within gap + 2 of a placed contour or within gap + 4 of its ends (a dot may go
            # there); far: within gap + 4 of a placed contour (a new contour's ends stay out)
            near = np.zeros((c.side, c.side), dtype=bool)
            far = np.zeros((c.side, c.side), dtype=bool)
            for _ in range(c.contours):
                for attempt in range(200):
                    if attempt % 20 == 0:             # a new shape, then 20 positions for it
                        shape = _shape(u, c.contour_length, c.max_turn)
                        while np.abs(shape[-1] - shape[0]).max() < 3:   # curled up: would hide its dots
                            shape = _shape(u, c.contour_length, c.max_turn)
                    try:
                        path = _place(u, shape, c.side)
                    except _Retry:
                        continue
                    ends = path[[0, -1]]
                    if not near[path[:, 0], path[:, 1]].any() and not far[ends[:, 0], ends[:, 1]].any():
                        paths.append(path)
                        _forbid(near, path, c.gap + 2)
                        _forbid(near, ends, c.gap + 4)
                        _forbid(far, path, c.gap + 4)
                        break
                else:
                    raise _Retry
            break
        except _Retry:
            continue
    else:
        raise ValueError(f"contours / contour_length: cannot place {c.contours} contours of {c.contour_length} "
                         f"steps {c.gap + 2} pixels apart in a {c.side}x{c.side} image; lower them or enlarge side")
    image = np.zeros((c.side, c.side), dtype=np.uint8)
    ids = np.full((c.side, c.side), -1, dtype=np.int8)
    for k, path in enumerate(paths):
        for (r, col) in _dashed(path.tolist(), c.dash, c.gap):
            image[r, col], ids[r, col] = INK, k
    dots = [tuple(paths[0][0]), tuple(paths[0][-1])] if positive else [tuple(paths[0][0]), tuple(paths[1][-1])]
    for k, (r, col) in zip((0, 0 if positive else 1), dots):
        image[r - 1:r + 2, col - 1:col + 2] = INK
        ids[r - 1:r + 2, col - 1:col + 2] = k
    return image, ids, dots


@dataclass(frozen=True)
class PathfinderConfig(TaskConfig):
    """Options of ``pathfinder``: side (32; Path-X: 128), contour_length (steps), contours (2 dotted
    candidates + distractors; >= 2), dash / gap (pixels), max_turn (degrees per step), examples
    per split, seed. Defaults are the easy 32x32 setting; Path-X: side 128, contour_length ~ 120."""

    side: int = 32
    contour_length: int = 16
    contours: int = 3
    dash: int = 2
    gap: int = 1
    max_turn: float = 25.0
    train_examples: int = 4000
    validation_examples: int = 500
    test_examples: int = 500
    seed: int = 0

    def __post_init__(self):
        check_int("side", self.side, 12)
        check_int("contour_length", self.contour_length, 4)
        check_int("contours", self.contours, 2)
        check_int("dash", self.dash, 1)
        check_int("gap", self.gap, 0)
        if isinstance(self.max_turn, bool) or not isinstance(self.max_turn, (int, float)) or not 0 <= self.max_turn <= 90:
            raise ValueError(f"max_turn: expected degrees in [0, 90], got {self.max_turn!r}")
        for name in ("train_examples", "validation_examples", "test_examples"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)


@register("pathfinder")
class Pathfinder(Task):
    """Pathfinder: one segment per split, label per image, head "classifier"."""

    Config = PathfinderConfig
    default_head = "classifier"
    splits = ("train", "validation", "test")
    generator_version = 1

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def n_classes(self) -> int:
        return 2

    @property
    def max_len(self) -> int:
        return self.config.side ** 2

    def images(self, split: str, with_ids: bool = False):
        """(images [N, S, S] uint8, labels [N]) and, with ``with_ids``, the contour id maps."""
        c = self.config
        self._check_split(split)
        n = {"train": c.train_examples, "validation": c.validation_examples, "test": c.test_examples}[split]
        u = Uniforms(np.random.Generator(np.random.PCG64(np.random.SeedSequence([c.seed, _SPLIT_CODE[split]]))))
        images, ids, labels = [], [], []
        for i in range(n):
            image, id_map, _ = render(u, c, positive=i % 2 == 0)
            images.append(image)
            ids.append(id_map)
            labels.append(int(i % 2 == 0))
        out = (np.stack(images), np.array(labels))
        return out + (np.stack(ids),) if with_ids else out

    def generate(self, split: str) -> List[Segment]:
        images, labels = self.images(split)
        flat = torch.from_numpy(images.reshape(len(images), -1).astype(np.int64))
        return [Segment(f"S{self.config.side}", flat, torch.from_numpy(labels), {"side": self.config.side})]

    def describe(self) -> str:
        c = self.config
        return "\n".join([
            "pathfinder: are the two dots joined by one dashed contour? (Linsley et al. 2018; LRA)",
            f"  {c.side}x{c.side} images as {c.side ** 2} pixel tokens; {c.contours} contours of {c.contour_length} steps, "
            f"dash {c.dash} / gap {c.gap}, turn <= {c.max_turn:g} degrees; balanced classes",
            f"  {c.train_examples} / {c.validation_examples} / {c.test_examples} train / validation / test; seed {c.seed}",
        ])

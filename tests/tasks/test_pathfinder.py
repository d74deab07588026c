"""Pathfinder: the label is what a flood fill of the drawn image says; classes balanced."""
from collections import deque

import numpy as np
import pytest
import torch

from lcsm import tasks

SMALL = dict(train_examples=120, validation_examples=40, test_examples=40)


def connected(image, a, b, reach):
    """Breadth-first search over lit pixels, stepping up to ``reach`` pixels in each direction."""
    lit = image > 0
    seen = np.zeros_like(lit)
    queue = deque([a])
    seen[a] = True
    while queue:
        r, c = queue.popleft()
        if (r, c) == b:
            return True
        for dr in range(-reach, reach + 1):
            for dc in range(-reach, reach + 1):
                rr, cc = r + dr, c + dc
                if 0 <= rr < lit.shape[0] and 0 <= cc < lit.shape[1] and lit[rr, cc] and not seen[rr, cc]:
                    seen[rr, cc] = True
                    queue.append((rr, cc))
    return False


def dots(image):
    """Centres of the 3x3 blocks of ink (the two markers)."""
    lit = image > 0
    full = lit[:-2, :-2] & lit[1:-1, :-2] & lit[2:, :-2] & lit[:-2, 1:-1] & lit[1:-1, 1:-1] & lit[2:, 1:-1] \
        & lit[:-2, 2:] & lit[1:-1, 2:] & lit[2:, 2:]
    return [(int(r) + 1, int(c) + 1) for r, c in zip(*np.nonzero(full))]


@pytest.mark.parametrize("options", [{}, {"side": 64, "contour_length": 40, "contours": 4, "gap": 2}])
def test_labels_equal_a_flood_fill_of_the_image(tmp_path, options):
    task = tasks.build("pathfinder", cache_dir=tmp_path, **SMALL, **options)
    c = task.config
    for split in task.splits:
        seg = task.dataset(split).segments[0]
        images = seg.inputs.long().reshape(-1, c.side, c.side).numpy()
        for image, label in zip(images, seg.labels.tolist()):
            assert set(np.unique(image)) <= {0, 255}
            marks = dots(image)
            assert len(marks) == 2, marks
            assert connected(image, marks[0], marks[1], c.gap + 1) == bool(label)
        assert seg.labels.float().mean() == 0.5


def test_splits_disjoint_and_deterministic(tmp_path):
    task = tasks.build("pathfinder", cache_dir=tmp_path, **SMALL)
    seen = {s: {bytes(r.numpy().astype(np.uint8)) for r in task.dataset(s).segments[0].inputs} for s in task.splits}
    assert not (seen["train"] & seen["test"] or seen["train"] & seen["validation"])
    again = tasks.build("pathfinder", use_cache=False, **SMALL)
    assert torch.equal(again.generate("test")[0].inputs, task.generate("test")[0].inputs)


def test_config_errors():
    with pytest.raises(ValueError, match="max_turn: expected degrees in \\[0, 90\\]"):
        tasks.build("pathfinder", max_turn=120)
    with pytest.raises(ValueError, match="cannot place 6 contours"):
        tasks.build("pathfinder", use_cache=False, side=16, contour_length=12, contours=6, train_examples=2).dataset("train")


def test_trains_end_to_end(train_tiny):
    result, losses = train_tiny({"name": "pathfinder", "side": 24, "contour_length": 10, "contours": 2, **SMALL},
                                steps=10, batch_size=20, d_model=16)
    assert len(losses) == 10 and all(np.isfinite(losses))
    assert result["metrics"]["accuracy"] in [i / 40 for i in range(41)]

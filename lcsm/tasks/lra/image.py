"""LRA image (substitute): sequential Fashion-MNIST, 784 grey pixels (0-255) as tokens, 10 classes
(LRA, Tay et al. 2020: grey CIFAR-10, 1024 pixels; CIFAR ships on no registry here). Fashion-MNIST
keeps its official test set and holds 5,000 training images out for validation.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lcsm._checks import check_int

from .._real_data import _RealDataTask
from ..base import register
from ..config import TaskConfig, check_data_dir
from ..data import Segment


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzip or plain): magic 0x0801 (labels, uint8) or 0x0803 (images, uint8)."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    magic = int.from_bytes(data[:4], "big")
    if magic >> 8 != 0x08 or magic & 0xFF not in (1, 3):
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {magic:#010x})")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(magic & 0xFF)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims))
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: {body.size} values, header says {dims}")
    return body.reshape(dims)


@dataclass(frozen=True)
class ImageConfig(TaskConfig):
    """max_examples: cap per split (null: all 55,000 / 5,000 / 10,000); data_dir: the unpacked
    Debian package (null: fetched); seed: which 5,000 training images are held out."""

    max_examples: int | None = None
    data_dir: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.max_examples is not None:
            check_int("max_examples", self.max_examples, 1)
        check_data_dir(self.data_dir)
        check_int("seed", self.seed, 0)


@register("image")
class LRAImage(_RealDataTask):
    """LRA image (substitute): sequential Fashion-MNIST, 784 pixel tokens, 10 classes."""

    Config = ImageConfig
    default_head = "classifier"
    source = "fashion_mnist"
    generator_version = 1
    HELD_OUT = 5000

    @classmethod
    def config_model_fields(cls, config: ImageConfig) -> dict[str, object]:
        return {"head": {"kind": cls.default_head, "n_classes": 10}, "vocab_size": 256}

    @property
    def max_len(self) -> int:
        return 784

    def generate(self, split: str) -> list[Segment]:
        base = self.source_dir() / "usr" / "share" / "datasets" / "fashion-mnist"
        prefix = "t10k" if split == "test" else "train"
        images = read_idx(base / f"{prefix}-images-idx3-ubyte.gz")
        labels = read_idx(base / f"{prefix}-labels-idx1-ubyte.gz")
        if split != "test":
            order = np.random.Generator(np.random.PCG64(self.config.seed)).permutation(len(images))
            rows = order[: self.HELD_OUT] if split == "validation" else order[self.HELD_OUT :]
            images, labels = images[np.sort(rows)], labels[np.sort(rows)]
        if self.config.max_examples:
            images, labels = images[: self.config.max_examples], labels[: self.config.max_examples]
        ids = torch.from_numpy(images.reshape(len(images), -1).astype(np.int64))
        return [Segment("L784", ids, torch.from_numpy(labels.astype(np.int64)), {"max_length": 784})]

    def describe(self) -> str:
        return (
            "image: sequential Fashion-MNIST (LRA image substitute), 784 pixel tokens, 10 classes; "
            "official test set, 5,000 training images held out for validation; accuracy"
        )

"""LRA text (substitute): byte-level document classification of BBC News articles, 5 topics, up
to ``max_length`` bytes (LRA, Tay et al. 2020: IMDB reviews, binary, 4096 bytes; IMDB needs the hub).
"""

from __future__ import annotations

from .._real_data import _DocumentTask
from ..base import register


@register("text")
class LRAText(_DocumentTask):
    """LRA text (substitute): byte-level BBC News topic classification."""

    source = "bbc_news"
    byte_level = True

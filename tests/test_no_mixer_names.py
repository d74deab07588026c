"""Models and the engine never decide by a mixer's name: what differs between mixers is a hook of
the Mixer class (``layer_options``, ``native_bidirectional``, ``model_owned_options``), so adding a
mixer touches one module of lcsm/layers only. A switch on a name (``if name == "hgrn"``, a table
keyed by names) is how runs of one mixer were once wrongly reused for another (commit bd13f86).

A name as data is fine: ModelConfig's default mixer and the presets' recipes name the mixer they
build, as a YAML config does. So this scans the places where a literal decides: an operand of a
comparison (also inside a tuple, list or set compared against), a key of a dict display, a match
case and a subscript."""

import ast
from pathlib import Path

import pytest

from lcsm import layers

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("lcsm/models", "lcsm/engine") for p in (ROOT / d).rglob("*.py"))


def _names() -> set[str]:
    return set(layers.available()) | set(layers.aliases())


def _deciding_literals(tree: ast.AST):
    """(line, value) of every str constant in a deciding position (see the module docstring)."""

    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for elt in node.elts:
                yield from strings(elt)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            parts = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.MatchValue):
            parts = [node.value]
        elif isinstance(node, ast.Subscript):
            parts = [node.slice]
        else:
            continue
        for part in parts:
            for const in strings(part):
                yield const.lineno, const.value


def mixer_name_switches(source: str) -> list[tuple[int, str]]:
    names = _names()
    return [(line, v) for line, v in _deciding_literals(ast.parse(source)) if v.partition(":")[0] in names]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_models_and_engine_do_not_switch_on_mixer_names(path):
    found = mixer_name_switches(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} decides by mixer name at (line, literal) {found}: add a Mixer hook"


def test_the_scan_finds_a_switch():
    """The scan itself: each deciding position is caught, and names as data are not."""
    switches = [
        'if cls.registry_name == "hgrn": pass',
        'if name in ("rwkv4", "ces"): pass',
        'OWNED = {"rwkv4": ("layer_id",)}',
        'x = OWNED["ces"]',
        'match name:\n    case "gla":\n        pass',
        'if spec != "lcsm:1-9-1-0": pass',
    ]
    for src in switches:
        assert mixer_name_switches(src), src
    assert not mixer_name_switches('mixer: str = "gla"\nbuild(mixer="ces")\ncmd = ["python", "-m", "lcsm"]')

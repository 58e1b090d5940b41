"""Model families with a home (`toptpu.families`): one table, a module per family, and the
family names resolved there and nowhere else (an AST scan of every other module)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
from dataclasses import replace

import pytest
from test_imports import MODULES, REPO

import toptpu.families as families
from toptpu.backend.formats.header_schema import HeaderError
from toptpu.backend.formats.llm_file import QwenVisionInfo, VisionInfo
from toptpu.families import (
    FAMILY_STRINGS,
    TEXT_FAMILIES,
    VISION_FAMILIES,
    text_family_of,
    vision_family,
    vlm_family_of,
)
from toptpu.families.base import FAMILY_KEYS, TextFamily, VisionFamily

#: modules that may spell family names and model types, and why
NAMED_ELSEWHERE = {
    "toptpu.frontends.tiny_models": "the test fixtures: a tiny config per named fixture "
                                    "(`llama2`, `qwen3_5`, ...), test data, not a code path",
    "toptpu.frontends.tiny_vlms": "the test fixtures of the VLMs, likewise",
    "toptpu.frontends.gguf_loader": "GGUF's own `general.architecture` names (`llama`, "
                                    "`qwen2`, `qwen3`): the file format's vocabulary",
}


def family_strings_in(tree: ast.AST, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) of every place `tree` resolves a family by its name: a comparison with
    one (==, !=, in, a match case), a table keyed by them (a dict, set, tuple or list
    literal of them) or a lookup by one (a subscript)."""
    out = []

    def named(node: ast.AST | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and node.value in names else None

    for node in ast.walk(tree):
        found: list[str | None] = []
        if isinstance(node, ast.Compare):
            found = [named(n) for side in (node.left, *node.comparators)
                     for n in ast.walk(side)]
        elif isinstance(node, ast.Dict):
            found = [named(k) for k in node.keys]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            found = [named(e) for e in node.elts]
        elif isinstance(node, ast.Subscript):
            found = [named(node.slice)]
        elif isinstance(node, ast.MatchValue):
            found = [named(node.value)]
        hits = [h for h in found if h is not None]
        if hits:
            out.append((node.lineno, f"{type(node).__name__} of {hits[0]!r}"))
    return out


def test_no_module_outside_the_families_compares_family_names() -> None:
    bad = []
    for module, path in sorted(MODULES.items()):
        if module == "toptpu.families" or module.startswith("toptpu.families."):
            continue
        if module in NAMED_ELSEWHERE:
            continue
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read(), path)
        bad += [f"{path}:{line}: {what}" for line, what in family_strings_in(tree,
                                                                               FAMILY_STRINGS)]
    assert not bad, ("family names resolved outside toptpu.families (ask the family "
                     "object instead):\n" + "\n".join(bad))
    for module in NAMED_ELSEWHERE:  # the exceptions stay true
        with open(os.path.join(REPO, MODULES[module])) as f:
            assert family_strings_in(ast.parse(f.read()), FAMILY_STRINGS), module


def test_the_scan_catches_a_planted_comparison() -> None:
    planted = '''
if info["kind"] == "qwenvl":
    pass
CLASSES = {"internvl": 1}
KINDS = ("minicpmv", "qwenvl")
x = TABLE["qwen3_5"]
match kind:
    case "llama":
        pass
ok = tiny_model("qwen2")  # a call naming a fixture is no comparison
'''
    assert [w for _, w in family_strings_in(ast.parse(planted), FAMILY_STRINGS)] == [
        "Compare of 'qwenvl'", "Dict of 'internvl'", "Tuple of 'minicpmv'",
        "Subscript of 'qwen3_5'", "MatchValue of 'llama'"]


def _family_modules() -> list[str]:
    return [f"toptpu.families.{m.name}" for m in pkgutil.iter_modules(families.__path__)
            if m.name != "base"]


def test_every_family_module_is_registered_once() -> None:
    """Each family a module of the package defines is an entry of the table, and each
    entry comes from one module."""
    found: dict[int, str] = {}
    for name in _family_modules():
        module = importlib.import_module(name)
        defined = [v for v in vars(module).values()
                   if isinstance(v, TextFamily | VisionFamily)
                   and (isinstance(v, TextFamily) or type(v).__module__ == name)]
        assert defined, f"{name} defines no family"
        for family in defined:
            found.setdefault(id(family), name)
    table = [*TEXT_FAMILIES.values(), *VISION_FAMILIES.values()]
    assert {id(f) for f in table} == set(found)
    assert len({f.name for f in TEXT_FAMILIES.values()}) == len(TEXT_FAMILIES)


def test_names_and_model_types_resolve_to_their_family() -> None:
    for family in TEXT_FAMILIES.values():
        for mt in family.model_types:
            assert text_family_of(mt) is family
    for family in VISION_FAMILIES.values():
        assert vision_family(family.name) is family
        for mt in family.model_types:
            assert vlm_family_of(mt) is family
        assert family.marker in family.tokens
        assert family.header_keys <= set(FAMILY_KEYS) and family.optional_keys <= set(
            FAMILY_KEYS)
        assert not family.header_keys & family.optional_keys
    assert text_family_of("gpt2") is None and vlm_family_of(None) is None
    with pytest.raises(Exception, match="unknown vision family 'nope'"):
        vision_family("nope")


def test_every_vision_family_has_its_compile_side_and_processor() -> None:
    """The torch side of compiling each family (its vision half's builder in the frontends)
    and the classes it names exist."""
    import transformers

    from toptpu.frontends.vlm import VISION_MODELS

    assert set(VISION_MODELS) == set(VISION_FAMILIES.values())
    for family in VISION_FAMILIES.values():
        assert hasattr(transformers, family.processor_class), family
        for cls in family.model_types.values():
            assert hasattr(transformers, cls), (family, cls)
    for family in TEXT_FAMILIES.values():
        assert hasattr(transformers, family.config_class), family


def _vision_info(family: VisionFamily) -> VisionInfo:
    """A valid vision header section of `family` (numbers of a tiny model)."""
    tokens = {t: f"<{t}>" for t in family.tokens}
    ids = {t: 10 + i for i, t in enumerate(family.tokens)}
    extra: dict[str, object] = {}
    if "max_patches" in family.header_keys:
        extra.update(max_patches=64, token_divisor=4)
    if "merge_levels" in family.header_keys:
        extra.update(merge_levels=((2, 2),), position_side=8)
    if "qwen" in family.header_keys:
        extra["qwen"] = QwenVisionInfo(merge_size=2, temporal_patch_size=2, video_token_id=40,
                                       vision_start_token_id=41, vision_end_token_id=42)
    return VisionInfo(kind=family.name, model_type=next(iter(family.model_types)), net="vit",
                      image_token_id=ids[family.marker], tokens=tokens, token_ids=ids,
                      processor_class=family.processor_class, processor={}, image_size=32,
                      patch_size=4, max_tiles=1, tokens_per_tile=16, config={}, mode="f32",
                      **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(VISION_FAMILIES))
def test_a_vision_header_section_is_checked_by_its_family(name: str) -> None:
    family = vision_family(name)
    info = _vision_info(family)
    info.check(vocab=100)
    assert info.family is family and info.position_axes in (1, 3)
    for key in FAMILY_KEYS:  # a key of another family does not apply to this one
        if key in family.header_keys or key in family.optional_keys:
            continue
        other = next(f for f in VISION_FAMILIES.values() if key in f.header_keys
                     or key in f.optional_keys)
        value = getattr(_vision_info(other), key) if key != "canvas_markers" else {"x": 1}
        with pytest.raises(HeaderError, match=f"vision.{key} does not apply to a {name} model"):
            replace(info, **{key: value}).check(vocab=100)
    for key in family.header_keys:  # and its own keys must be there
        with pytest.raises(HeaderError, match=f"vision.{key} is missing"):
            replace(info, **{key: None}).check(vocab=100)

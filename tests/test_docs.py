"""docs/protocol.md says what the spec says: its numbered properties name the predicates that state
them, its progress and non-vacuity lists are the spec's, and the rules it cites exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcc.spec import rules, vocabulary
from kvcc.spec.properties import INVARIANTS, SOMETIMES, TRANSITION_PROPERTIES

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "docs" / "protocol.md"
SAFETY_NUMBERS = range(1, 14)

PROPERTY_HEADING = re.compile(r"^### Property (\d+) — ", re.MULTILINE)
SECTION_HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)


def _text() -> str:
    return PROTOCOL.read_text(encoding="utf-8")


def _sections(text: str, heading: re.Pattern) -> dict[int, str]:
    """Each heading's number -> the text up to the next heading of the same level."""
    marks = list(heading.finditer(text))
    out: dict[int, str] = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        number = int(mark.group(1))
        assert number not in out, f"{heading.pattern}: {number} twice"
        out[number] = text[mark.start() : end]
    return out


def _property_sections() -> dict[int, str]:
    text = _text()
    safety = _sections(text, SECTION_HEADING)[9]
    return _sections(safety, PROPERTY_HEADING)


def _numbers(design: str) -> set[int]:
    """The property numbers a predicate's ``design`` field names ("8,12" -> {8, 12})."""
    return {int(part) for part in design.split(",") if part.strip().isdigit()}


def test_safety_properties_numbered_1_to_13_in_order():
    text = _text()
    assert [int(m.group(1)) for m in PROPERTY_HEADING.finditer(text)] == list(SAFETY_NUMBERS)


@pytest.mark.parametrize("prop", INVARIANTS + TRANSITION_PROPERTIES, ids=lambda p: p.name)
def test_each_predicate_is_named_under_each_property_it_states(prop):
    sections = _property_sections()
    numbers = _numbers(prop.design)
    if prop.kind == "safety":
        assert numbers, f"{prop.name}: a safety property with no number ({prop.design!r})"
    for n in numbers:
        assert n in sections, f"{prop.name} states property {n}, which docs/protocol.md lacks"
        assert f"`{prop.name}`" in sections[n], f"property {n} does not name {prop.name}"
        assert f"`{prop.holds.__name__}`" in sections[n], f"property {n} does not name {prop.holds.__name__}"


def test_no_property_section_names_a_predicate_that_does_not_state_it():
    sections = _property_sections()
    for prop in INVARIANTS + TRANSITION_PROPERTIES:
        for n, section in sections.items():
            if f"`{prop.name}`" in section:
                assert n in _numbers(prop.design), f"property {n} names {prop.name} (design {prop.design!r})"


def test_progress_section_names_every_progress_predicate():
    progress = _sections(_text(), SECTION_HEADING)[10]
    for prop in INVARIANTS:
        if prop.kind == "progress":
            assert f"`{prop.name}`" in progress, prop.name
            assert f"`{prop.holds.__name__}`" in progress, prop.holds.__name__
    for label in ("P1", "P2", "P3", "P4", "Deletion reaches everywhere"):
        assert f"**{label}" in progress, label


def test_non_vacuity_table_is_the_spec_list():
    section = _sections(_text(), SECTION_HEADING)[11]
    rows = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert rows == [sm.name for sm in SOMETIMES]


def test_rules_the_document_cites_exist():
    """Every ``rules.name`` and every rule named in the phase table is a function of spec/rules.py."""
    text = _text()
    cited = set(re.findall(r"`rules\.(\w+)`", text))
    table = _sections(text, SECTION_HEADING)[2]
    for row in re.findall(r"^\|.*\| ([^|]*) \|$", table, re.MULTILINE):
        cited |= set(re.findall(r"`(\w+)`", row))
    assert cited, "no rule cited: the patterns no longer match the document"
    missing = sorted(name for name in cited if not callable(getattr(rules, name, None)))
    assert not missing, f"docs/protocol.md cites rules spec/rules.py lacks: {missing}"


def test_refusal_reasons_the_document_cites_exist():
    """The refusals the document quotes are words of ``vocabulary.DIRECTORY_REASONS`` (the wire's too)."""
    text = _text()
    quoted = {
        "unauthorized", "parent_not_committed", "lease_expired", "stale_epoch", "unknown_lease",
        "not_owner", "invalidating", "leased", "restarting", "location_down",
    }  # fmt: skip
    for reason in sorted(quoted):
        assert f"`{reason}`" in text, reason
        assert reason in vocabulary.DIRECTORY_REASONS, reason


# -- citations across the tree ---------------------------------------------------------------------

CITED_FILE_SUFFIXES = (".py", ".md", ".json")
NOT_THE_TREE = {".git", ".venv", "node_modules", "__pycache__", ".hypothesis", "build", "dist"}
PROPERTY_CITATION = re.compile(r"\bprotocol propert(?:y|ies) (\d+(?:\s*[,/]\s*\d+)*)")
# The old design brief, cited by number or by name; spelled in two halves so this file does not cite it.
OLD_BRIEF = re.compile(r"\b" + "DES" + r"IGN\b")


def _tree_files():
    """The project's own text files: every cited suffix outside tools' and VCS folders."""
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in NOT_THE_TREE for part in rel.parts):
            continue
        if path.suffix in CITED_FILE_SUFFIXES and path.is_file():
            yield rel, path.read_text(encoding="utf-8", errors="replace")


def test_every_cited_protocol_property_exists():
    sections = _property_sections()
    cited: dict[int, list[str]] = {}
    for rel, text in _tree_files():
        for match in PROPERTY_CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            for n in re.split(r"\s*[,/]\s*", match.group(1)):
                cited.setdefault(int(n), []).append(f"{rel}:{line}")
    assert len(cited) >= 10, "the tree cites protocol properties: the pattern no longer matches"
    missing = {n: where[:3] for n, where in cited.items() if n not in sections}
    assert not missing, f"cited protocol properties docs/protocol.md lacks: {missing}"


def test_no_citation_of_the_old_design_brief_remains():
    left = [
        f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
        for rel, text in _tree_files()
        for m in OLD_BRIEF.finditer(text)
    ]
    assert not left, f"cite docs/protocol.md ('protocol property n') instead: {left[:20]}"

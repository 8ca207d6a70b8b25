"""Records are built by name: every dataclass or NamedTuple of the package with more than three
fields is constructed with keyword arguments, and every keyword names one of its fields."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cgx2"


def _trees() -> dict[str, ast.Module]:
    root = PACKAGE.parent
    return {str(p.relative_to(root)): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def _records(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each record's name and the fields its constructor takes (a name defined twice: both)."""
    records: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            bases = [ast.unparse(b) for b in node.bases]
            if not any("dataclass" in d for d in decorators) and "NamedTuple" not in bases:
                continue
            fields = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and "ClassVar" not in ast.unparse(s.annotation)
                and not (s.value is not None and "init=False" in ast.unparse(s.value))
            }
            records.setdefault(node.name, set()).update(fields)
    return records


def _calls(trees: dict[str, ast.Module], records: dict[str, set[str]]):
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if name in records:
                yield path, node, name


def _constructions():
    """Each call that builds a record: its file, the call, the record's name and fields."""
    trees = _trees()
    records = _records(trees)
    for path, node, name in _calls(trees, records):
        yield path, node, name, records[name]


def test_records_of_more_than_three_fields_are_built_by_keyword():
    positional = [
        f"{path}:{node.lineno} {name}(...) with {len(node.args)} positional arguments"
        for path, node, name, fields in _constructions()
        if len(fields) > 3 and node.args
    ]
    assert not positional, "\n".join(positional)


def test_every_keyword_of_a_records_construction_names_one_of_its_fields():
    unknown = [
        f"{path}:{node.lineno} {name}(...): {sorted(extra)}"
        for path, node, name, fields in _constructions()
        if (extra := {k.arg for k in node.keywords if k.arg} - fields)
    ]
    assert not unknown, "\n".join(unknown)

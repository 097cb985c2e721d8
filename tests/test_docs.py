"""docs/artifacts.md's field tables match the schemas, so the contract document cannot go stale."""

from rltune.contracts.docs import DOC, TABLES, regenerate, render


def test_artifacts_doc_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert regenerate(text) == text, "docs/artifacts.md is stale: run 'python -m rltune.contracts.docs'"


def test_every_table_renders_and_has_its_marker():
    text = DOC.read_text(encoding="utf-8")
    for name in TABLES:
        assert f"<!-- fields:{name} -->" in text
        body = render(name)
        assert body is not None and body.count("\n") >= 2, f"table {name} rendered nothing"

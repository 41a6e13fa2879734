"""The documentation's generated pages match the code they describe, and README stays short."""

from __future__ import annotations

from pathlib import Path

from scripts import gen_docs

ROOT = Path(__file__).resolve().parents[2]


def test_generated_pages_are_fresh() -> None:
    stale = gen_docs.stale()
    assert not stale, f"{', '.join(stale)} stale: run `{gen_docs.COMMAND}` and commit the result"


def test_configuration_page_lists_every_setting_and_alias() -> None:
    from po_backend.core.settings import ALIASES, FIELDS
    from po_backend.server.args import ServerArgs

    page = gen_docs.configuration_page()
    for name in [*FIELDS, *ALIASES, *(f for f in ServerArgs.__dataclass_fields__ if f != "engine")]:
        assert f"`{name}`" in page, name
    # The SGLang name sits on its setting's row.
    row = next(line for line in page.splitlines() if line.startswith("| `chunk_size` |"))
    assert "`chunked_prefill_size`" in row and "`--chunk-size`" in row


def test_stale_page_is_reported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    for page, make in gen_docs.PAGES.items():
        (tmp_path / page).write_text(make())
    assert gen_docs.stale() == []
    (tmp_path / "docs/cli.md").write_text("old\n")
    assert gen_docs.stale() == ["docs/cli.md"]
    assert gen_docs.main(["--check"]) == 1


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "bash scripts/dev.sh demo" in readme and "bash scripts/dev.sh test" in readme


def test_every_docs_page_is_in_the_nav() -> None:
    """mkdocs --strict (the lint step) fails on a page left out of the nav; this names it sooner."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.name for p in (ROOT / "docs").glob("*.md")]
    missing = [p for p in pages if f" {p}" not in nav]
    assert not missing, f"add these pages to mkdocs.yml's nav: {missing}"

"""README.md is a front page: it starts with the two commands, stays within 160 lines (reference material lives in
docs/), and every page it links to exists."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_front_page_starts_with_the_two_commands_stays_short_and_links_only_to_pages_that_exist():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move reference material to docs/"
    first_block = text.split("```")[1]
    assert first_block.splitlines()[1].startswith("make demo") and first_block.splitlines()[2].startswith("make test")
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)", text)
    assert links and all((README.parent / link).exists() for link in links), links

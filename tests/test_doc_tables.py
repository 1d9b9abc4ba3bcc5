"""Tables in docs/ that quote the dry run's output are what the planner says now (harness/doc_tables.py): a change
that moves a figure fails here until `make docs` regenerates the table. Dry runs in process: no launcher."""

import pytest

from harness.doc_tables import COMMAND, TABLES, current


@pytest.mark.parametrize("name", TABLES)
def test_each_generated_table_is_current(name):
    page, make = TABLES[name]
    assert current(name) == make(), f"{page}'s {name} table is stale: run `{COMMAND}` (or `make docs`)"

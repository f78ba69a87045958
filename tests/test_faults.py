"""tests/faults.py plants each of its bugs by replacing one exact piece of source text: every piece must occur exactly
once in its file, or the planted-fault run (`python tests/faults.py`) stops on it, or plants nothing."""

import pytest
from faults import FAULTS, ROOT


@pytest.mark.parametrize("fault", FAULTS, ids=[fault.name for fault in FAULTS])
def test_each_fault_replaces_one_piece_of_source(fault):
    count = (ROOT / fault.path).read_text().count(fault.old)
    assert count == 1, f"{fault.name!r}: the text to replace occurs {count} times in {fault.path}"

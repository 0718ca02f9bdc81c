import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_draft, make_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny random Qwen3 target and DFlash drafter in the real on-disk formats."""
    root = tmp_path_factory.mktemp("tiny")
    return make_target(root / "target"), make_draft(root / "draft")

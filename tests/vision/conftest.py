"""mlx-vlm's own generation on the demo vision model, the ground truth of these tests."""

from __future__ import annotations

import pytest

from tests.vision.support import VlmReference


@pytest.fixture(scope="session")
def reference(demo_vlm_dir) -> VlmReference:
    return VlmReference(demo_vlm_dir)

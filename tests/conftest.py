import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("STRATA_NO_PROGRESS", "1")

from tiny_models import ARCH_CONFIGS, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """{arch: (path, hf_model)} for every supported architecture, built once per session."""
    out = {}
    for arch in ARCH_CONFIGS:
        path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
        out[arch] = (path, save_tiny_model(arch, path))
    return out

"""Fixtures the server tests share: the embedded model's tokenizer, and an HTTP client of a module's
`server` fixture carrying that module's `KEY`."""

import httpx
import pytest

from strata.loaders import default_model_path
from strata.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return Tokenizer.from_hf_dir(default_model_path())


@pytest.fixture(scope="module")
def http(request, server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {request.module.KEY}"}, timeout=60) as c:
        yield c

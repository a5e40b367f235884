"""Strata: an LLM inference server."""

from strata.params import SamplingParams
from strata.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in the loaders and models; import it on first use so `strata --help` stays fast.
    if name == "LLM":
        from strata.llm import LLM

        return LLM
    raise AttributeError(name)

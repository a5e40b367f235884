"""Data helpers shared by training, tests and evaluation (kept free of heavy dependencies)."""

from strata.data.retrieval import KINDS, RetrievalExample, iter_retrieval_examples, make_retrieval_example

__all__ = ["KINDS", "RetrievalExample", "iter_retrieval_examples", "make_retrieval_example"]

"""Shared helpers for the tests (import as ``from helpers import ...``)."""

from conftest import SHARED, assert_tree_allclose, tree_allclose

__all__ = ["SHARED", "assert_tree_allclose", "tree_allclose"]

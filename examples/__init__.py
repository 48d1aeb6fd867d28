"""Tiny complete examples that the tests also run."""

"""Fake of the vllm-ascend package of the same path (see tests/fakes/__init__.py)."""

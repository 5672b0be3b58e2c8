"""Only the optional C loop of the page-hash chain; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pd_cache.core._chain", ["pd_cache/core/_chain.c"], optional=True)])

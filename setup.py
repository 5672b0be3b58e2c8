"""Only the optional C loops: the page-hash chain and decode's attention step; everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("pd_cache.core._chain", ["pd_cache/core/_chain.c"], optional=True),
    Extension("pd_cache.model._attend", ["pd_cache/model/_attend.c"], optional=True,
              extra_compile_args=["-O3"]),
])

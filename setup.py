"""Build hook for the one compiled module, kvroute._hashchain (the block-hash chain, DESIGN.md §2).

Everything else is in pyproject.toml. The extension is optional: without a C compiler or the Python
headers the install still succeeds and kvroute.hashing uses its numpy path (same bytes, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvroute._hashchain",
            sources=["kvroute/_hashchain.c"],
            libraries=["dl"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)

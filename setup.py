"""Build hook for the two compiled modules; everything else is in pyproject.toml.

- kvroute._hashchain: the block-hash chain (DESIGN.md §2), for router and replicas.
- replica.attention._cpu_paged: paged decode attention on the CPU, K/V read in place.
- router._index: the router index's hot loops (event ingest, the lookup's walk).

All are optional: without a C compiler or the Python headers the install still succeeds, and
kvroute.hashing uses its numpy path, the torch attention backend its gather + SDPA path, the
router index its accumulate + bisection walk (same results, slower).
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
        ),
        Extension(
            "replica.attention._cpu_paged",
            sources=["replica/attention/_cpu_paged.c"],
            libraries=["m"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension("router._index", sources=["router/_index.c"], extra_compile_args=["-O2"], optional=True),
    ]
)

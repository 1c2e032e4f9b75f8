"""Build hook for the compiled modules; everything else is in pyproject.toml.

- kvroute._hashchain: the block-hash chain (DESIGN.md §2), for router and replicas.
- replica.attention._cpu_paged: paged decode attention on the CPU, K/V read in place.
- router._index: the router index's storage (one table per medium) and its lookup walk.
- router._scoring: the default cost over every candidate of a decision.

All are optional: without a C compiler or the Python headers the install still succeeds, and
kvroute.hashing uses its numpy path, the torch attention backend its gather + SDPA path, the
router index its Python dicts and accumulate + bisection walk, the cost its loop over Candidate
objects (same results, slower).
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
        # No fused multiply-adds: the costs must equal the Python sum's bit for bit (ties are exact).
        Extension("router._scoring", sources=["router/_scoring.c"], extra_compile_args=["-O2", "-ffp-contract=off"],
                  optional=True),
    ]
)

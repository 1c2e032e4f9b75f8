"""The local tools: the ``kvroute`` command (``up``, ``generate``, ``bench``), trace replay and the
embedded Redis. The top layer: it may import ``kvroute``, ``router`` and ``replica``; nothing imports it
but tests and benchmarks.
"""

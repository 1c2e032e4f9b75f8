"""``python -m kvroute_tools.resolve_model MODEL CACHE_DIR``: print the model folder a replica given
``--model MODEL --model-cache-dir CACHE_DIR`` would load, generating the default model on first use.

``kvroute up`` runs it once, in a child python, before it starts the replicas: N replicas would
otherwise race to write the default model, and ``up`` itself stays free of torch. It resolves with
the replica's own code (``replica.server.resolve_model_dir``), so ``up`` and the replicas agree.
Exit 0 with the folder as the last line of stdout; any failure is a traceback and a non-zero exit.
"""

from __future__ import annotations

import sys

from replica.server import resolve_model_dir
from replica.settings import ReplicaSettings


def main(argv: list[str] | None = None) -> int:
    """Print the resolved model folder of ``argv = [model, model_cache_dir]`` (either may be "")."""
    model, cache_dir = sys.argv[1:] if argv is None else argv
    print(resolve_model_dir(ReplicaSettings(model=model, model_cache_dir=cache_dir))[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

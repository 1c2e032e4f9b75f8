"""``python -m kvroute_tools.resolve_model MODEL CACHE_DIR``: print the model folder a replica given
``--model MODEL --model-cache-dir CACHE_DIR`` would load, generating the default model on first use.

``kvroute up`` runs it once, in a child python, before it starts the replicas: N replicas would
otherwise race to write the default model, and ``up`` itself stays free of torch. It resolves with
the replica's own code (``replica.server.resolve_model_dir``), so ``up`` and the replicas agree.
``--tokenizer-only`` (``MODEL`` must be "") writes the default model's folder without its weights
and without torch: what a router needs (the chart's router init container, in the router image).
Exit 0 with the folder as the last line of stdout; any failure is a traceback and a non-zero exit.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Print the resolved model folder of ``argv = [--tokenizer-only,] model, model_cache_dir``
    (either may be ""). Raises SystemExit (2) for ``--tokenizer-only`` with a model named."""
    args = list(sys.argv[1:] if argv is None else argv)
    tokenizer_only = args[:1] == ["--tokenizer-only"]
    model, cache_dir = args[1:] if tokenizer_only else args
    if tokenizer_only:
        if model:
            raise SystemExit("resolve_model: --tokenizer-only writes the default model; the model must be \"\"")
        from kvroute.prompt import default_model_dir
        from replica.model.default_model import ensure_default_model

        print(ensure_default_model(default_model_dir(cache_dir), weights=False))
        return 0
    from replica.server import resolve_model_dir
    from replica.settings import ReplicaSettings

    print(resolve_model_dir(ReplicaSettings(model=model, model_cache_dir=cache_dir))[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

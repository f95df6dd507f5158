"""`python -m pipeline` and the `quantize` command. The bytecode cache is prepared before the command line's own
imports (pydantic, yaml) and long before torch's (`pipeline.bytecode`); scikit-learn and SciPy, which transformers
imports for features no command uses, wait until something calls them (`pipeline.deferred`)."""

import sys

from quantize.errors import UserError

from . import bytecode, deferred


def main(argv: list[str] | None = None) -> int:
    try:
        bytecode.prepare_for(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # before the command line exists, so answered here the way it answers
        print(f"error: {e}", file=sys.stderr)
        return 2
    deferred.defer_imports()
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())

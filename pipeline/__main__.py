"""`python -m pipeline` and the `quantize` command. The bytecode cache is prepared before the command line's own
imports (pydantic, yaml) and long before torch's (`pipeline.bytecode`)."""

import sys

from . import bytecode


def main(argv: list[str] | None = None) -> int:
    bytecode.prepare_for(sys.argv[1:] if argv is None else argv)
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())

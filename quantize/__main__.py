import sys

from . import precompile

precompile.spawn(sys.argv[1:])  # before torch is imported: the GPTQ kernel compiles while the imports run

from .cli import main  # noqa: E402

raise SystemExit(main())

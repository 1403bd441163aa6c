"""python -m fa2cpu.bench: the fa2cpu-bench command."""
import sys

from .cli import main

sys.exit(main())

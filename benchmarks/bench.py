"""The attnmerge benchmark (the same as `python -m attnmerge bench`); see attnmerge/bench.py.
    python benchmarks/bench.py [--cpu] [--quick] [--json FILE] [--png FILE]
"""
import sys

from attnmerge.bench import main

if __name__ == "__main__":
    sys.exit(main())

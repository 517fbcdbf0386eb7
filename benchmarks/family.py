"""The N-way and variable-length merges on one GPU (the same as `python -m attnmerge bench
--family`); see attnmerge/bench/family.py.
    python benchmarks/family.py [--json FILE]
"""
import sys

from attnmerge.bench import main

if __name__ == "__main__":
    sys.exit(main(["--family", *sys.argv[1:]]))

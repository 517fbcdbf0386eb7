"""The package's own benchmark, `python -m attnmerge bench` (attnmerge.bench: the sweep, --cpu, and
--family), run from the driver: its command line is the package's, after the routine's name."""
from attnmerge.bench import main


def forward(name, argv):
    """Runs `python -m attnmerge bench` (name "bench") or `... bench --family` ("family") with argv."""
    return main((["--family"] if name == "family" else []) + list(argv))

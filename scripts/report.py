"""Tables and plots of a run or a sweep.

python scripts/report.py outputs/multiruns/<timestamp>     # writes <dir>/report/report.md and PNGs
"""

import argparse
import sys
from pathlib import Path

from experiments.sweeps.report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="a sweep dir (outputs/multiruns/...) or one run's dir")
    args = parser.parse_args()
    if not args.dir.is_dir():
        sys.exit(f"error: {args.dir} is not a directory; expected a run or sweep dir under outputs/")
    try:
        path = write_report(args.dir)
    except FileNotFoundError as err:
        sys.exit(f"error: {err}")
    print(path)


if __name__ == "__main__":
    main()

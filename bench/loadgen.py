"""Load generator: `python bench/loadgen.py --url http://127.0.0.1:8000 --rate 20 --duration 10`.

The same as `batchpilot loadgen`; the code lives in batchpilot_tools.loadgen.
"""

import sys

from batchpilot_tools.loadgen import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

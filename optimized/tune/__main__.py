"""`python -m optimized.tune`: the calibration run (optimized/tune/calibrate.py)."""
import sys

from .calibrate import main

sys.exit(main())

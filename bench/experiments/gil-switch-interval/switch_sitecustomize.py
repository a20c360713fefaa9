"""On PYTHONPATH as sitecustomize: SWITCH_MS=<ms> sets the interpreter's switch interval."""
import os
import sys

if os.environ.get("SWITCH_MS"):
    sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1000)

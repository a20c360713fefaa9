import os, sys
if os.environ.get("SWITCH_MS"):
    sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1000)

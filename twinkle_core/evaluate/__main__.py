"""Entry point: `python -m twinkle_core.evaluate EVAL_CONFIG.json`."""
import sys

from twinkle_core.evaluate.run import main

if __name__ == "__main__":
    sys.exit(main())

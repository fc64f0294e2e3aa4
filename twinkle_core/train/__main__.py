"""Entry point: `python -m twinkle_core.train RUN_CONFIG.json` (torchrun starts it in each worker)."""
import sys

from twinkle_core.train.recipe import main

if __name__ == "__main__":
    sys.exit(main())

"""Entry point: `python -m twinkle_core.train RUN_CONFIG.json` (torchrun starts it in each worker)."""
from twinkle_core.entry import finish_worker
from twinkle_core.train.recipe import main

if __name__ == "__main__":
    finish_worker(main())

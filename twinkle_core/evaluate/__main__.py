"""Entry point: `python -m twinkle_core.evaluate EVAL_CONFIG.json`."""
from twinkle_core.entry import finish_worker
from twinkle_core.evaluate.run import main

if __name__ == "__main__":
    finish_worker(main())

"""`python -m twinkle_core.families README.md` regenerates the supported-models table in place."""
import sys

from twinkle_core.families.table import update_readme

if __name__ == "__main__":
    changed = update_readme(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    print("README table updated" if changed else "README table already up to date")

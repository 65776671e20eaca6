"""`python scripts/train.py --config config.json [--resume_from_checkpoint PATH] [section.key=value ...]`

The seed documents' entry point; the same as `llm-trainer train`. Works under torchrun too.
"""

import sys

from llm_trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

"""``python -m e3attn.train``: the training command (:mod:`e3attn.train.cli`)."""
from .cli import main

if __name__ == "__main__":
    main()

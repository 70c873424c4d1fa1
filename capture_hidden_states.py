"""Multi-process capture: `accelerate launch --config_file recipes/launch/ddp.yaml
capture_hidden_states.py --recipe R`; each process captures its own slice and shards."""
import sys

from draftsmith.cli import main

if __name__ == "__main__":
    sys.exit(main(["capture", *sys.argv[1:]]))

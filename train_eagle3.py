"""Cluster entry point: `accelerate launch --config_file recipes/launch/<ddp|fsdp|zero2|zero3>.yaml
train_eagle3.py --recipe recipes/<target>/eagle3.yaml [key=value ...]`. How to launch lives in the
accelerate config; what to train lives in the recipe."""
import sys

from draftsmith.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

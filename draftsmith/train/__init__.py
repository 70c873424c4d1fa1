"""Layer 4, the one trainer (trainer.py) for every head kind, its batch sources (batches.py),
tracking (tracking.py) and the train stage (run.py). Never imports runtime/."""

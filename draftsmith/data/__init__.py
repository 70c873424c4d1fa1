"""Layer 3, the data side: conversations -> tokens + loss masks (conversations.py, prepare.py),
regeneration (regen.py), the capture stage (capture.py) and its store (records.py, store.py), the
draft vocabulary (vocab.py). Imports recipe, artifacts and targets/; never heads/."""

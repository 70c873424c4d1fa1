"""EAGLE-2: model.py (the EAGLE-1 network on the target's final features), loss.py (feature
regression + soft CE, with training-time test), draft.py (dynamic trees over the full vocabulary),
formats.py (SGLang EAGLE and vLLM eagle export; import of published EAGLE-1 heads)."""
from draftsmith.heads.eagle2 import formats
from draftsmith.heads.eagle2.draft import Eagle2Drafter
from draftsmith.heads.eagle2.model import Eagle2Head
from draftsmith.heads.registry import HeadSpec
from draftsmith.targets.features import FINAL

SPEC = HeadSpec(kind="eagle2", model=Eagle2Head, drafter=Eagle2Drafter, formats=formats, features=FINAL)

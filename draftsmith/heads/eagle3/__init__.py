"""EAGLE-3: model.py (head + config), loss.py (training-time test), draft.py (dynamic-tree drafter),
formats.py (SGLang, vLLM, speculators export and import)."""
from draftsmith.heads.eagle3 import formats
from draftsmith.heads.eagle3.draft import Eagle3Drafter
from draftsmith.heads.eagle3.model import Eagle3Head, default_layer_ids
from draftsmith.heads.registry import HeadSpec
from draftsmith.targets.features import FeatureNeeds

SPEC = HeadSpec(kind="eagle3", model=Eagle3Head, drafter=Eagle3Drafter, formats=formats,
                features=FeatureNeeds("layers", default_layer_ids))
